"""`VideoCall`: the arguments of one `pipe(...)` / `pipe.stream(...)` call, as given, written once.

diffusers keeps an explicit signature on `__call__`; here that signature is this dataclass's: `stream` and
`__call__` take `VideoCall`'s `__signature__` (the way our models take diffusers' `__init__` signature), so
`help(pipe)`, `inspect.signature` and notebooks show every argument with its type and default, and the list
exists once. `CALL_ARGUMENTS` is its one docstring, in diffusers' typed style; a test checks it documents
every field. `rolldiff.pipelines.request.builder.build_request` turns a `VideoCall` into the frozen
`VideoRequest` the chunk loop reads.

A recipe (`rolldiff.recipes`) fills the fields a call leaves `None`; the session server and the CLI build a
`VideoCall` from their messages and flags, so every front end resolves a call the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch


@dataclass(frozen=True, eq=False)
class VideoCall:
    """One call's arguments, unchecked (`build_request` checks them); `None` means "the recipe's, else the
    model's". Field order is the signature's: four positional arguments, the rest keyword-only."""

    prompt: str | list[str] | None = None
    num_frames: int = 81
    height: int | None = None
    width: int | None = None
    _: KW_ONLY
    prompt_schedule: Sequence[tuple[int, str]] | dict[int, str] | None = None
    scene_cuts: Sequence[int] | None = None
    negative_prompt: str | list[str] | None = None
    prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None
    denoising_steps: Sequence[float] | None = None
    guidance_scale: float = 1.0
    generator: torch.Generator | list[torch.Generator] | None = None
    latents: torch.Tensor | None = None
    output_type: str = "np"
    max_sequence_length: int | None = None
    callback_on_step_end: Callable | None = None
    callback_on_step_end_tensor_inputs: list[str] | None = None
    chunk_frames: int | None = None
    sink_frames: int | None = None
    window_frames: int | str | None = None
    position_mode: str | None = None
    attention_bias: float | None = None
    kv_quantization: str | None = None
    kv_offload: bool | None = None
    attention_bias_mode: str | None = None
    sink_mode: str | None = None
    elastic_window: bool | None = None
    context_window_frames: int | None = None
    adaptive_sink: bool | None = None
    adaptive_sink_threshold: float | None = None
    image: Any = None
    video: Any = None
    strength: float | None = None
    image_mode: str | None = None
    overlap_decode: bool = False
    recipe: str | None = None
    sigma_mapping: str | None = None
    sigmas: Sequence[float] | None = None
    integer_timesteps: bool | None = None
    timestep_shift: float | None = None
    first_chunk_steps: Sequence[float] | None = None
    context_noise: float | None = None
    context_policy: str | None = None
    first_chunk: str | None = None
    recache: str | None = None
    recompute_first_frame: str | None = None
    prompt_blend_chunks: int | None = None
    denoising: str | None = None
    video_denoising_steps: Sequence[float] | None = None
    video_noise_mix: str | None = None
    normalize_input_latents: bool | None = None
    devices: Sequence[str | torch.device] | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def bind(cls, method: str, args: tuple, kwargs: dict[str, Any]) -> VideoCall:
        """`VideoCall(*args, **kwargs)`, with a misspelt or extra argument named as `method`'s (not this class's)."""
        try:
            return cls(*args, **kwargs)
        except TypeError as error:
            message = str(error).replace(f"{cls.__name__}.__init__()", f"{method}()")
            unknown = [name for name in kwargs if name not in cls.names()]  # Python's message names the first
            raise TypeError(message + (_instead_of(unknown[0]) if unknown else "")) from None

    def replace(self, **changes: Any) -> VideoCall:
        return dataclasses.replace(self, **changes)


# Arguments of diffusers' pipelines (and habits from them) that a call here spells another way.
_DIFFUSERS_ARGUMENTS = {
    "num_inference_steps": "`denoising_steps` takes the step values, e.g. [1000, 750, 500, 250] (their count is the "
    "number of steps); the default is the recipe's, the steps its few-step checkpoint was distilled for",
    "timesteps": "`denoising_steps` takes the step values, in [0, 1000], strictly decreasing",
    "num_videos_per_prompt": "pass the prompt once per video, `prompt=[text] * n`: each batch element draws its own noise",
    "seed": "pass `generator=torch.Generator().manual_seed(seed)`",
    "fps": "frames carry no rate; give it to `export_to_video(frames, path, fps=...)` or `generate_to_file(path, fps=...)`",
}


def _instead_of(name: str) -> str:
    """A hint for an argument a call does not take: its spelling here, or the nearest argument names."""
    if name in _DIFFUSERS_ARGUMENTS:
        return f"; {_DIFFUSERS_ARGUMENTS[name]}"
    close = difflib.get_close_matches(name, VideoCall.names(), n=3, cutoff=0.75)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def call_signature(extra: Sequence[inspect.Parameter] = ()) -> inspect.Signature:
    """`VideoCall`'s signature with `self` first (and `extra` keyword-only parameters last): a method's."""
    parameters = list(inspect.signature(VideoCall).parameters.values())
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return inspect.Signature([this, *parameters, *extra])


def takes_call_arguments(extra: Sequence[inspect.Parameter] = ()) -> Callable[[Callable], Callable]:
    """Give a `(self, *args, **kwargs)` method `VideoCall`'s signature and `CALL_ARGUMENTS` under its docstring."""

    def decorate(method: Callable) -> Callable:
        method.__signature__ = call_signature(extra)
        method.__doc__ = (inspect.cleandoc(method.__doc__ or "") + "\n" + CALL_ARGUMENTS).strip()
        return method

    return decorate


CALL_ARGUMENTS = """
Args:
    prompt (`str` or `list[str]`, *optional*):
        The text, or one per batch element. Omit it when `prompt_schedule` starts at frame 0 or `prompt_embeds`
        are given.
    num_frames (`int`, *optional*, defaults to 81):
        Pixel frames; whole chunks (`pipe.num_frames_for(seconds, fps, **call)` or `valid_num_frames` tells the
        nearest valid counts).
    height (`int`, *optional*):
        Pixels, a multiple of the VAE factor times the patch size. Defaults to the config's `height`.
    width (`int`, *optional*):
        Pixels, as `height`. Defaults to the config's `width`.
    prompt_schedule (`list[tuple[int, str]]` or `dict[int, str]`, *optional*):
        `[(frame, prompt), ...]` switches in pixel frames; each takes effect at the next chunk boundary.
    scene_cuts (`list[int]`, *optional*):
        Frames of `prompt_schedule` switches that are hard scene cuts (Infinity-RoPE's RoPE cut,
        yesiltepe-hidir/infinity-rope `wan/modules/causal_model.py:27-44`): the first chunk of the new prompt sits at
        RoPE frame 45 while the frames before it keep their places, a jump in time the model renders as a cut.
        Needs `position_mode="relative"` (keys stored before RoPE), a fixed sink and `denoising="sequential"`.
    negative_prompt (`str` or `list[str]`, *optional*):
        The unconditional branch's text when `guidance_scale > 1`.
    prompt_embeds (`torch.Tensor`, *optional*):
        Precomputed text embeddings `(batch, tokens, channels)` for the first prompt.
    negative_prompt_embeds (`torch.Tensor`, *optional*):
        Precomputed embeddings of the negative prompt.
    denoising_steps (`list[float]`, *optional*):
        Step values in [0, 1000], strictly decreasing, the first above 0 (only the last may be 0: Krea's);
        warped by `sigma_mapping`. Defaults to the recipe's, else the config's.
    guidance_scale (`float`, *optional*, defaults to 1.0):
        Above 1 enables classifier-free guidance, with a cache of its own for the negative branch.
    generator (`torch.Generator` or `list[torch.Generator]`, *optional*):
        One generator (or one per batch element); chunk k's noise is drawn when chunk k starts.
    latents (`torch.Tensor`, *optional*):
        Starting noise for the whole video `(batch, channels, latent_frames, h, w)`.
    output_type (`str`, *optional*, defaults to `"np"`):
        `"np"`, `"pil"`, `"pt"` or `"latent"`.
    max_sequence_length (`int`, *optional*):
        Text tokens. Defaults to the config's.
    callback_on_step_end (`Callable`, *optional*):
        `callback(pipe, step, timestep, tensors) -> dict`, called after every denoising step with the next step's
        input `latents`; returned `latents` replace them. `pipe.interrupt = True` (or the stream's
        `interrupt()`) stops before the next step: the output holds the chunks finished so far.
    callback_on_step_end_tensor_inputs (`list[str]`, *optional*):
        The tensors the callback receives: `"latents"`, `"prompt_embeds"`.
    chunk_frames (`int`, *optional*):
        Latent frames generated per chunk (a cache option: `None` takes the recipe's, else the config's).
    sink_frames (`int`, *optional*):
        First latent frames, never evicted (the attention sink).
    window_frames (`int` or `"all"`, *optional*):
        Most recent latent frames attended to after the sink, counting the chunk; `"all"` keeps every frame
        (LongSANA). A window longer than the video is shortened to what the video can fill.
    position_mode (`str`, *optional*):
        `"absolute"` (keys after RoPE, bounded by the RoPE table) or `"relative"` (re-indexed, unbounded length).
    attention_bias (`float`, *optional*):
        Krea's KV-cache bias in (0, 1]: `log(bias)` added to past tokens' scores (1 = off).
    kv_quantization (`str`, *optional*):
        `"int8"` or `"fp8"`: store the K/V window quantized (about half of bf16).
    kv_offload (`bool`, *optional*):
        Keep the committed K/V window in CPU memory; each block's comes in when it runs.
    attention_bias_mode (`str`, *optional*):
        `"past"` (every earlier token biased) or `"scope"` (the first frame and the chunk unbiased).
    sink_mode (`str`, *optional*):
        `"fixed"` (the sink keeps the first frames; the default) or `"rolling"` (Rolling Sink,
        haodong2000/RollingSink `wan/modules/causal_model.py:232-283`: once the video passes the first
        `window_frames - chunk_frames` frames, each chunk, when the next one commits, is replaced by those first
        frames walked forward and back, at its own positions; needs `position_mode="relative"`, no KV quantization
        or offload).
    elastic_window (`bool`, *optional*):
        The window counts the latent frames actually being denoised, not the largest chunk: fewer frames in flight
        see more committed frames (`window_frames` minus those in flight). Rolling Forcing's window forward,
        thu-ml/Causal-Forcing `long_video/wan/modules/causal_model.py:266-272`, whose window of in-flight chunks
        empties at the end of the video (`denoising="pipelined"`).
    context_window_frames (`int`, *optional*):
        The latent frames the context pass (the clean pass that writes a chunk's K/V) attends to, counting the chunk:
        the last ones of the video ending with it, the sink among them only while inside that span. Rolling
        Forcing's clean pass (`causal_model.py:247-262`: the last 21 frames). `None`: the denoising window's view.
    adaptive_sink (`bool`, *optional*):
        StreamDiffusionV2's adaptive sink (chenfengxu714/StreamDiffusionV2 `models/wan/causal_model.py:268-342`):
        a cache of `sink_frames + window_frames` frame slots where, at every denoising step and in every transformer
        block, a one-frame chunk whose mean key and value resemble some sink frame less than
        `adaptive_sink_threshold` (cosine similarity) replaces that sink frame, the ring of the other slots
        following upstream's eviction queue (`rolldiff.caching.AdaptiveSinkLayer`). Needs `chunk_frames=1`,
        `position_mode="absolute"`, batch 1, no KV quantization, offload, attention bias, `sink_mode="rolling"`,
        `first_chunk_steps`, and an eager transformer, or under `denoising="pipelined"` one compiled by
        `compile_cached_step` (its in-flight forwards decide nothing; the deciding ones run eager). A start image (`image_mode="frame"`) is committed by one t=0 pass
        into the fresh cache. Defaults to `False`.
    adaptive_sink_threshold (`float`, *optional*):
        The adaptive sink's similarity threshold in [-1, 1] (upstream's `adapt_sink_threshold`, 0.2 in
        `configs/wan_causal_dmd_v2v.yaml`; -1 never refreshes). Only with `adaptive_sink=True`.
    image (`PIL.Image.Image`, `str`, `os.PathLike`, `np.ndarray` or `torch.Tensor`, *optional*):
        A start frame (image-to-video), or one per batch element: a picture file's path (read when the call is
        checked), `(H, W, 3)` arrays, `(3, H, W)` tensors. It is encoded and becomes the clean first context: frame
        0 of the video is the image.
    video (`str`, `np.ndarray` or iterator of frames, *optional*):
        An input video (video-to-video), streamed chunk by chunk: a file path, an `(F, H, W, 3)` array or any
        iterator of frames (a webcam included). The output ends with the input.
    strength (`float`, *optional*):
        With `video`: how much of each input chunk is replaced, in (0, 1] (default 0.8, diffusers'); of the N
        denoising steps the last `int(N * strength)` run.
    image_mode (`str`, *optional*):
        With `image`: `"chunk"` (Krea: the image repeated over the first chunk; the default) or `"frame"`
        (Self-Forcing / CausVid: its one latent frame is the first context; `num_frames` is then one latent frame
        and whole chunks). `None` takes the recipe's.
    overlap_decode (`bool`, *optional*, defaults to `False`):
        On CUDA, decode chunk k on a side stream while chunk k + 1 denoises (the same frames, in order).
    recipe (`str`, *optional*):
        A checkpoint's own inference settings (`rolldiff.recipes.list_recipes()`); explicit arguments win.
        Defaults to the one the pipeline folder's `model_index.json` names.
    sigma_mapping (`str`, *optional*):
        How steps become sigmas: `"shift"` (diffusers'; the default), `"table"` or `"linear"`
        (`rolldiff.pipelines.request.steps`).
    sigmas (`list[float]`, *optional*):
        Explicit sigmas in (0, 1], one per denoising step, instead of the mapping.
    integer_timesteps (`bool`, *optional*):
        Truncate the timesteps fed to the model to integers (LongSANA).
    timestep_shift (`float`, *optional*):
        The shift of the sigma mapping. Defaults to the recipe's, else the scheduler's.
    first_chunk_steps (`list[float]`, *optional*):
        The first denoised chunk's own step list, mapped like `denoising_steps` (Causal Forcing++'s
        `denoising_step_list_first_chunk`, thu-ml/Causal-Forcing `pipeline/causal_inference.py:36-45`, used at
        `:203-207`: its 1- and 2-step frame-wise models run their first frame in 4 steps). Explicit `sigmas` apply
        to `denoising_steps` only.
    context_noise (`float`, *optional*):
        The timestep of the context pass in [0, 1000) (Self-Forcing's `context_noise`; 0: clean).
    context_policy (`str`, *optional*):
        `"rolling"` (commit each chunk's K/V once, from a clean context pass; the default), `"recompute"` (Krea:
        each chunk rebuilds its context from the last clean latents in one t = 0 pass) or `"last_step"`
        (StreamDiffusionV2, `models/wan/causal_stream_inference.py:298-348`: no context pass, every denoising step
        writes the cache and the last step's K/V are what is committed; under `denoising="pipelined"`, the leaving
        chunk's writes of the forward it left in; a start image's chunk, which runs no step, by its context pass).
    first_chunk (`str`, *optional*):
        `"whole"` (every chunk alike; the default), `"remainder"` (the first chunk takes the leftover frames:
        LongSANA), `"frame"` (one latent frame: a start image's, with `image_mode="frame"`) or `"extra_frame"`
        (one latent frame more than the others: the video's lone first pixel frame joins the first chunk, 1 + 4
        pixel frames for chunks of one latent frame; StreamDiffusionV2, `streamv2v/inference_wo_batch.py:256-283`;
        `num_frames` is then one latent frame and whole chunks; with `adaptive_sink` only).
    recache (`str`, *optional*):
        The re-cache after a prompt switch: `"causal"` (the default), `"longlive"` or `"longsana"`, as the family
        offers, or `"flush"` (Infinity-RoPE's KV flush, `pipeline/causal_inference.py:213-222`: nothing re-run; the
        window keeps its last 2 frames after the sink, the gap closed up; needs `position_mode="relative"`).
    recompute_first_frame (`str`, *optional*):
        Under `context_policy="recompute"`: `"keep"` (the first latent frame as made; the default) or `"reencode"`
        (Krea: re-encoded from the last chunk's decoded pixels; needs the VAE).
    prompt_blend_chunks (`int`, *optional*):
        A prompt switch blends the embeddings over this many chunks (Krea: 4; 1 switches at once).
    denoising (`str`, *optional*):
        `"sequential"` (the default: a chunk runs all its steps, then the next starts) or `"pipelined"` (Rolling
        Forcing's rolling window, thu-ml/Causal-Forcing `long_video/pipeline/rolling_forcing_inference.py:169-230`):
        as many chunks as there are steps are in flight at staggered noise levels and denoised in ONE forward, each
        advancing one step; the cleanest leaves clean (context pass, commit) and a fresh noisy chunk enters, so a
        chunk costs one forward of a longer sequence instead of one forward per step. The in-flight chunks count in
        `window_frames` (attention sees the sink, the `window_frames - steps x chunk_frames` latest committed frames
        and every in-flight chunk; the adaptive sink keeps them in a region after its slots instead); not with
        `first_chunk_steps` or `video_noise_mix="motion"`. Krea-like pipelines. Or `"stream_batch"`
        (StreamDiffusionV2's stream batch, chenfengxu714/StreamDiffusionV2 `streamv2v/inference.py:298-371`,
        `models/wan/causal_stream_inference.py:202-296`): the first chunk is denoised alone, its cache is then copied
        into one cache per step, and every later forward is a batch of one row per step, row r holding the chunk
        that entered r forwards ago at step r and attending to and writing its own cache only (rows never meet);
        a chunk leaves every forward once the batch is full. Needs `context_policy="last_step"` and
        `adaptive_sink=True` (`recipe="streamdiffusionv2"`), no guidance, one prompt, no `first_chunk_steps`.
    video_denoising_steps (`list[float]`, *optional*):
        With `video`: the input chunks' own step list, mapped like `denoising_steps` (StreamDiffusionV2 denoises an
        input video with 700/500/400/200, `configs/wan_causal_dmd_v2v.yaml`). Defaults to `denoising_steps`.
    video_noise_mix (`str`, *optional*):
        With `video`: how an input chunk is noised. `"sigma"` (diffusers'; the default): to the sigma of the step
        `strength` cuts the list at, and only the steps from there run. `"strength"`: `strength * noise + (1 -
        strength) * input`, and every step of the list runs (StreamDiffusionV2's `noise_scale`,
        `streamv2v/inference_wo_batch.py:273-274`). `"motion"`: as `"strength"` for the first chunk; each later chunk
        is mixed at `s = 0.9 (strength - 0.1 m) + 0.1 s_prev`, where `m` is the chunk's motion (the largest RMS
        difference of a pixel frame from the one before, over 0.2, at most 1), and its first step is fed
        `int(1000 s) - 100` (`streamv2v/inference.py:51-57`).
    normalize_input_latents (`bool`, *optional*):
        With `video`: `False` feeds the transformer the input's latents as the VAE encodes them, without Wan's
        per-channel `(x - mean) / std` (StreamDiffusionV2's `stream_encode(..., is_scale=False)`,
        `models/wan/wan_wrapper.py:134-141`; its decoder still denormalises). Defaults to `True`. A start image is
        frame 0 of the output, so it is always normalised (the decoder's space), under any recipe.
    devices (`list[str]`, *optional*):
        Pipeline parallelism: the transformer's blocks split into `len(devices)` contiguous stages, stage r on
        `devices[r]` in a process of its own (`["cpu", "cpu"]` over gloo, `["cuda:0", "cuda:1", ...]` over NCCL; the
        first is the pipeline's device and runs here). The frames equal one process's to float tolerance; only
        rank 0 decodes. Under `denoising="stream_batch"` the rows of each forward are in flight through the stages
        at once (StreamDiffusionV2's multi-GPU schedule: more stages, more speed; no `state_dict()` once batching).
        Krea-like pipelines; not with `callback_on_step_end`, nor `adaptive_sink` outside `"stream_batch"`; an
        interrupt takes effect at the next chunk boundary. See docs/pipeline_parallel.md.
"""

"""`VideoRequest`: one video's call arguments, validated once, group by group, into a frozen dataclass.

`build_request` (`rolldiff.pipelines.request.builder`) makes it from a `VideoCall` with the checks of each
group of arguments below (output, frames and size, guidance, prompts, latents, generator, callback, loop
options) before any model work. Everything downstream (the chunk loop in `ChunkStream`, resume, the demo, the
session server) reads typed fields instead of a `dict` of options looked up by string.

A family's cache options are a frozen dataclass of their own (`CacheOptions` subclasses in the family's
pipeline file) that resolves call values against the pipeline config and validates itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ...caching.layout import ChunkLayout
from ...checks import ArgumentKindError, check_choice, check_int, check_number, is_int
from .conditioning import strength_steps
from .prompt_schedule import PromptSchedule

if TYPE_CHECKING:
    from .conditioning import Conditioning
    from .steps import StepMapping, StepPlan

OUTPUT_TYPES = ("np", "pil", "pt", "latent")


@dataclass(frozen=True)
class CacheOptions:
    """A family's cache options: each field is a call argument whose `None` means "the pipeline config's value".

    Subclasses declare their fields and validate them in `__post_init__` (errors name the argument and what is
    allowed). `resolve` builds one from the call's values and the config.
    """

    # Call arguments every video family accepts under these names (the Krea-like pipeline's), so callers can
    # drive every family alike; a family without one of them refuses any value but None.
    known_names: ClassVar[tuple[str, ...]] = (
        "chunk_frames",
        "sink_frames",
        "window_frames",
        "position_mode",
        "attention_bias",
        "kv_quantization",
        "kv_offload",
        "attention_bias_mode",
        "sink_mode",
        "elastic_window",
        "context_window_frames",
        "adaptive_sink",
        "adaptive_sink_threshold",
    )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def resolve(cls, config: Mapping[str, Any], given: Mapping[str, Any], owner: str) -> CacheOptions:
        """The options of one call: `given` values where not None, else the pipeline config's."""
        names = cls.names()
        unknown = sorted(name for name, value in given.items() if name not in names and value is not None)
        if unknown:
            raise TypeError(f"{owner} got unexpected argument(s) {unknown}; its cache options are {list(names)}.")
        return cls(**{name: config[name] if given.get(name) is None else given[name] for name in names})

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class VideoGeometry:
    """Frames and sizes of one video, in pixels and latents. Every chunk has `chunk_frames` latent frames except
    the first, which may take the leftover frames too (`first_chunk_frames`, LongSANA's rule)."""

    num_frames: int
    height: int
    width: int
    num_latent_frames: int
    chunk_shape: tuple[int, int, int, int, int]  # (batch, channels, chunk_frames, latent height, latent width)
    first_chunk_frames: int  # `chunk_frames` unless the first chunk's rule says otherwise

    @property
    def batch_size(self) -> int:
        return self.chunk_shape[0]

    @property
    def chunk_frames(self) -> int:
        return self.chunk_shape[2]

    @property
    def first_chunk(self) -> int:
        return self.first_chunk_frames

    @property
    def num_chunks(self) -> int:
        return 1 + (self.num_latent_frames - self.first_chunk) // self.chunk_frames

    def chunk_start(self, index: int) -> int:
        """First latent frame of chunk `index`."""
        return 0 if index == 0 else self.first_chunk + (index - 1) * self.chunk_frames

    @property
    def last_chunk_start(self) -> int:
        """First latent frame of the video's last chunk (a prompt switch after it would never apply)."""
        return self.chunk_start(self.num_chunks - 1)

    def chunk_size(self, index: int) -> int:
        return self.first_chunk if index == 0 else self.chunk_frames

    def shape_of(self, index: int) -> tuple[int, int, int, int, int]:
        """`(batch, channels, frames, h, w)` of chunk `index`."""
        batch, channels, _, height, width = self.chunk_shape
        return (batch, channels, self.chunk_size(index), height, width)


@dataclass(frozen=True)
class VideoRequest:
    """Everything one generation needs, validated before any work (made by `build_request`)."""

    geometry: VideoGeometry
    layout: ChunkLayout
    options: CacheOptions
    schedule: PromptSchedule
    step_plan: StepPlan
    guidance_scale: float
    negative_prompt: tuple[str, ...] | None
    max_sequence_length: int
    output_type: str
    prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None
    latents: torch.Tensor | None = None
    generator: torch.Generator | list[torch.Generator] | None = None
    callback_on_step_end: Callable | None = None
    callback_tensor_inputs: tuple[str, ...] = ("latents",)
    conditioning: Conditioning | None = (
        None  # a start image or an input video (`rolldiff.pipelines.request.conditioning`)
    )
    context_policy: str = "rolling"  # "recompute": each chunk rebuilds its context in one t = 0 pass (Krea)
    overlap_decode: bool = False  # decode chunk k on a side stream while chunk k + 1 denoises (CUDA)
    recache_mode: str = "causal"  # after a prompt switch: "causal" (chunk by chunk), "longlive" (one pass), "flush"
    scene_cuts: tuple[int, ...] = ()  # prompt-schedule entries whose switch is a scene cut (Infinity-RoPE), sorted
    recompute_first_frame: str = "keep"  # "reencode": Krea's first context frame re-encoded from decoded pixels
    prompt_blend_chunks: int = 1  # a prompt switch blends the embeddings over this many chunks (Krea: 4)
    context_noise: float = 0.0  # the timestep of the context pass (Self-Forcing's `context_noise`; 0: clean)
    recipe: str | None = None  # the named recipe these settings came from (`rolldiff.recipes`)
    first_step_plan: StepPlan | None = None  # the first denoised chunk's own steps (Causal Forcing++)
    denoising: str = "sequential"  # "pipelined": every step's chunk in flight, one forward for all (Rolling Forcing)
    video_step_plan: StepPlan | None = None  # an input video's chunks' own steps (`video_denoising_steps`)
    video_noise_mix: str = "sigma"  # how an input chunk is noised: "sigma", "strength" or "motion" (StreamDiffusionV2)
    normalize_input_latents: bool = True  # False: input latents as the VAE encodes them (StreamDiffusionV2)
    step_mapping: StepMapping | None = None  # how steps map to sigmas, for a first step chosen at run time
    in_flight_frames: int = 0  # pipelined: the latent frames in flight at most (one chunk per step)
    devices: tuple[str, ...] | None = None  # pipeline parallelism: one device per stage (`pipelines.parallel`)

    def step_plan_for(self, chunk: int) -> StepPlan:
        """The steps chunk `chunk` is denoised with: the first denoised chunk's own plan, if any (a start image's
        chunk 0 is not denoised, so that is chunk 1 then), else `step_plan`; a video-to-video chunk runs
        `video_step_plan` (else `step_plan`): its last `strength` part when noised to a step's sigma
        (`video_noise_mix="sigma"`), all of it when `strength` is the noise mix itself (the first step of a later
        chunk may then be chosen by the input's motion: `ChunkStream`)."""
        conditioning = self.conditioning
        first_denoised = 1 if conditioning is not None and conditioning.image is not None else 0
        if self.first_step_plan is not None and chunk == first_denoised:
            return self.first_step_plan
        if conditioning is not None and conditioning.video is not None:  # from the input noised to `strength`
            plan = self.step_plan if self.video_step_plan is None else self.video_step_plan
            if self.video_noise_mix != "sigma":
                return plan
            return plan.tail(strength_steps(len(plan.steps), conditioning.strength))
        return self.step_plan

    @property
    def writes_per_chunk(self) -> int:
        """Cache writes of one denoised chunk: its steps, plus the context pass unless the last step's K/V are what
        is committed (`context_policy="last_step"`); pipelined, one (its commit or its context pass). The same for every
        chunk (checked where it matters)."""
        if self.denoising == "pipelined":
            return 1
        return len(self.step_plan_for(1).steps) + (self.context_policy != "last_step")

    @property
    def denoising_steps(self) -> tuple[float, ...]:
        return self.step_plan.steps

    @property
    def batch_size(self) -> int:
        return self.geometry.batch_size

    @property
    def num_chunks(self) -> int:
        return self.geometry.num_chunks

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        return self.geometry.chunk_shape

    @property
    def num_latent_frames(self) -> int:
        return self.geometry.num_latent_frames

    @property
    def uses_guidance(self) -> bool:
        return self.guidance_scale > 1.0

    @property
    def reencodes(self) -> bool:
        """Whether each rebuilt context's first frame is re-encoded from the last chunk's decoded pixels (the
        recompute policy with `recompute_first_frame="reencode"`): chunk k + 1 then needs chunk k's pixels, so the
        stream decodes serially (no `overlap_decode`) and keeps those pixels."""
        return self.context_policy == "recompute" and self.recompute_first_frame == "reencode"


# ---------------------------------------------------------------------------------------- argument groups
def check_output_type(output_type: Any) -> str:
    return check_choice("output_type", output_type, OUTPUT_TYPES)


def check_num_frames(num_frames: Any) -> int:
    return check_int("num_frames", num_frames, 1)


def check_size(name: str, size: Any, multiple: int, why: str) -> int:
    """A pixel side: a positive multiple of `multiple` (`why` says where the multiple comes from)."""
    message = f"`{name}` must be a positive multiple of {multiple} ({why}), got {size!r}."
    if not is_int(size):
        raise ArgumentKindError(message)
    if size < 1 or size % multiple:
        raise ValueError(message)
    return int(size)


CONTEXT_POLICIES = ("rolling", "recompute", "last_step")


def check_context_policy(policy: Any) -> str:
    """The policy: "rolling" (a context pass per chunk), "recompute" (the context rebuilt before each chunk; its size
    is checked against the final layout, `check_recompute_fits`) or "last_step" (no context pass: each step writes
    the cache, the last step's K/V are committed)."""
    return check_choice(
        "context_policy", policy, CONTEXT_POLICIES, hint="'last_step': StreamDiffusionV2, no clean context pass"
    )


def check_recompute_fits(policy: str, layout: ChunkLayout, pipelined: bool = False) -> None:
    """ "recompute" writes its whole context (sink + window - chunk frames) in one pass, as one chunk: at most the
    layout's chunk (`pipelined`: every chunk in flight, which the layout's chunk then is)."""
    context = layout.full_window_frames
    if policy == "recompute" and context > layout.chunk_frames:
        limit = (
            f"the {layout.chunk_frames} latent frames `denoising='pipelined'` keeps in flight"
            if pipelined
            else f"`chunk_frames`={layout.chunk_frames}"
        )
        raise ValueError(
            f"`context_policy='recompute'` rebuilds {context} context frames (sink + window - chunk) in one pass, "
            f"at most {limit}: lower `window_frames` / `sink_frames` (Krea: sink 0, window 6, chunk 3)."
        )


FIRST_FRAME_RULES = ("keep", "reencode")


def check_recache(mode: Any, allowed: tuple[str, ...]) -> str:
    """`mode` must be one of the re-cache modes the pipeline's family offers (`allowed`)."""
    return check_choice("recache", mode, allowed, hint="the re-cache modes of this pipeline's family")


def check_first_frame(rule: Any) -> str:
    return check_choice("recompute_first_frame", rule, FIRST_FRAME_RULES)


def check_blend_chunks(chunks: Any) -> int:
    return check_int("prompt_blend_chunks", chunks, 1, hint="1: switch at once")


def check_context_noise(context_noise: Any) -> float:
    return check_number(
        "context_noise", context_noise, 0, 1000, below=True, hint="the context pass's timestep; 0: clean"
    )


def check_guidance_scale(guidance_scale: Any) -> float:
    return check_number("guidance_scale", guidance_scale, 1.0, hint="1.0 disables guidance")


def check_embeds(name: str, embeds: Any, batch_size: int | None = None) -> torch.Tensor:
    if not isinstance(embeds, torch.Tensor) or embeds.ndim != 3:
        got = f"shape {tuple(embeds.shape)}" if isinstance(embeds, torch.Tensor) else type(embeds).__name__
        raise ValueError(f"`{name}` must be a (batch, tokens, channels) tensor, got {got}.")
    if batch_size is not None and embeds.shape[0] != batch_size:
        raise ValueError(f"`{name}` has batch {embeds.shape[0]}, expected {batch_size}.")
    if not torch.isfinite(embeds).all():
        raise ValueError(f"`{name}` contain NaN or infinite values.")
    return embeds


def check_negative_prompt(
    negative_prompt: Any, negative_prompt_embeds: Any, guidance_scale: float, batch_size: int
) -> tuple[str, ...] | None:
    """The negative prompts to encode (None when guidance is off or embeddings are given)."""
    if negative_prompt_embeds is not None:
        check_embeds("negative_prompt_embeds", negative_prompt_embeds, batch_size)
        return None
    if guidance_scale <= 1.0:
        return None
    negatives = [negative_prompt or ""] * batch_size if not isinstance(negative_prompt, list) else negative_prompt
    if len(negatives) != batch_size or not all(isinstance(text, str) for text in negatives):
        raise ValueError(
            f"`negative_prompt` must be a str or a list of {batch_size} str (one per batch element), got "
            f"{negative_prompt!r}."
        )
    return tuple(negatives)


def check_latents(latents: Any, shape: tuple[int, ...]) -> torch.Tensor | None:
    if latents is None:
        return None
    if not isinstance(latents, torch.Tensor) or tuple(latents.shape) != shape:
        got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
        raise ValueError(f"`latents` must be a tensor of shape {shape}, got {got}.")
    if not torch.isfinite(latents).all():
        raise ValueError("`latents` contain NaN or infinite values.")
    return latents


def check_generator(generator: Any, batch_size: int) -> None:
    if generator is None:
        return
    generators = generator if isinstance(generator, list) else [generator]
    if not all(isinstance(g, torch.Generator) for g in generators):
        raise ArgumentKindError(
            f"`generator` must be a torch.Generator or a list of them, got {type(generator).__name__} "
            "(use torch.Generator().manual_seed(seed))."
        )
    if isinstance(generator, list) and len(generator) != batch_size:
        raise ValueError(f"`generator` is a list of {len(generator)}, expected one per batch element ({batch_size}).")


def check_callback(callback: Any, names: Any, allowed: tuple[str, ...]) -> tuple[str, ...]:
    if callback is not None and not callable(callback):
        raise ArgumentKindError(f"`callback_on_step_end` must be callable, got {type(callback).__name__}.")
    names = ["latents"] if names is None else list(names)
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(f"`callback_on_step_end_tensor_inputs` has {unknown}; allowed: {list(allowed)}.")
    return tuple(names)

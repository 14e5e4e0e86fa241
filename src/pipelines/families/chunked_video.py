"""`ChunkedVideoPipeline`: what every autoregressive video pipeline shares (Krea-like, LongSANA-like).

`stream(...)` and `__call__(...)` take one signature, `VideoCall`'s (`rolldiff.pipelines.request.call`): the
arguments become a `VideoCall`, `build_request` resolves and checks it into a frozen `VideoRequest`, and
`stream` returns a `ChunkStream` (`rolldiff.pipelines.stream`), the live generation that owns its caches,
decoder, scheduler copy and position. `__call__` and `generate_to_file` are thin users of that stream, so the
three give the same frames, and one pipeline serves concurrent callers.

A family subclasses this with its options dataclass (`options_class`, a `CacheOptions`) and the hooks at the
bottom (`make_layout`, `transformer_step`, `recache_frames`, `recache`, and optionally `make_stream_cache`,
`make_decoder`); its transformer implements `rolldiff.models.family.VideoTransformer`. See
docs/model_families.md.
"""

from __future__ import annotations

import inspect
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import get_device
from diffusers.video_processor import VideoProcessor

from ...caching.layout import ChunkLayout
from ...checks import looks_like_a_path
from ...models.placement import loads_weights_per_call
from ...models.tiny_autoencoder import TinyVideoAutoencoder
from ...models.weights import check_pipeline_weights, resolve_dtype
from ..acceleration import capture_cuda_graphs, enable_fp8, fastest_attention_backend, set_attention_backend
from ..codecs.streaming_decode import StreamingWanDecoder
from ..codecs.streaming_encode import StreamingWanEncoder
from ..codecs.streaming_tiny_decode import StreamingTinyDecoder
from ..conversion.adapter import load_kept_adapter, saved_without_adapter
from ..io.resume import write_video
from ..lora import loaded_adapters
from ..memory import enable_fp8_storage, enable_offload
from ..request.builder import build_request, num_frames_for
from ..request.call import VideoCall, takes_call_arguments
from ..request.request import CacheOptions, VideoRequest, check_size
from ..request.text_encoding import check_max_sequence_length, check_prompts, encode_prompts
from ..stream import ChunkStream

RETURN_DICT = inspect.Parameter("return_dict", inspect.Parameter.KEYWORD_ONLY, default=True, annotation="bool")


class CacheAllocationError(MemoryError):
    """The stream's cache does not fit in memory; the message names the settings that size it."""


@dataclass
class ChunkedVideoPipelineOutput(BaseOutput):
    """`frames`: `(batch, frames, height, width, 3)` np in [0, 1], a list of PIL lists, `(batch, frames, 3, H, W)`
    torch, or latents `(batch, channels, latent_frames, h, w)` for `output_type="latent"`."""

    frames: np.ndarray | list[list[PIL.Image.Image]] | torch.Tensor | None


def concat_chunks(chunks: list[Any], output_type: str) -> Any:
    """Join a stream's items along time: what `__call__` returns for the whole video."""
    if not chunks:
        return None
    if output_type == "latent":
        return torch.cat(chunks, dim=2)
    if output_type == "pt":
        return torch.cat(chunks, dim=1)
    if output_type == "pil":
        return [[image for chunk in chunks for image in chunk[b]] for b in range(len(chunks[0]))]
    return np.concatenate(chunks, axis=1)


def refuse_a_missing_folder(class_name: str, source: str) -> None:
    """A path that is not a folder, said so: diffusers would take it for a Hub id and report "Repo id must be in the
    form 'repo_name' or 'namespace/repo_name'", and a checkpoint file belongs to `from_original`."""
    if Path(source).expanduser().is_file():
        raise FileNotFoundError(
            f"{class_name}.from_pretrained: {source!r} is a file; it takes a pipeline folder (save_pretrained, "
            f"`rolldiff convert`) or a Hub id. An original checkpoint file: {class_name}.from_original(checkpoint, "
            "base=...)."
        )
    if looks_like_a_path(source):
        raise FileNotFoundError(f"{class_name}.from_pretrained: no such folder {source!r}.")


class ChunkedVideoPipeline(DiffusionPipeline):
    """Base of the autoregressive video pipelines: the call (`VideoCall`'s signature, resolved by `build_request`),
    streams, writing, and the frame arithmetic and codecs the stream and the builder read.

    Subclasses register their components and config (`denoising_steps`, `max_sequence_length`, `height`,
    `width` and every field of `options_class`), call `set_vae_factors(vae)`, and implement the family hooks.
    """

    options_class: type[CacheOptions] = CacheOptions
    cache_options: tuple[str, ...] = ()  # the names of `options_class`'s fields (set for each subclass)
    recache_modes: tuple[str, ...] = ("causal",)  # the re-cache modes the family offers (`recache=`)
    output_class = ChunkedVideoPipelineOutput
    _callback_tensor_inputs = ["latents", "prompt_embeds"]

    def __init__(self) -> None:
        super().__init__()
        self._streams_lock = threading.Lock()
        self._running_streams: weakref.WeakSet = weakref.WeakSet()  # the streams `pipe.interrupt = True` reaches

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.cache_options = cls.options_class.names()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """diffusers' loader, after refusing a local folder whose model weights do not match their config.json
        (diffusers would only warn and leave layers random or drop weights)."""
        folder = Path(str(pretrained_model_name_or_path)).expanduser()
        if folder.is_dir():
            check_pipeline_weights(folder)
        else:
            refuse_a_missing_folder(cls.__name__, str(pretrained_model_name_or_path))
        pipe = super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        adapter = pipe.config.get("lora_adapter")
        if adapter is not None:  # a LoRA kept beside the transformer (`rolldiff convert --keep-lora-adapter`)
            hub = {key: kwargs[key] for key in ("cache_dir", "local_files_only", "token", "revision") if key in kwargs}
            load_kept_adapter(pipe.transformer, pretrained_model_name_or_path, adapter, **hub)
        return pipe

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """diffusers' save, with a kept LoRA adapter written apart from the plain transformer weights. Adapters
        loaded with `load_lora_weights` are refused, before anything is written: diffusers would write their
        PEFT-wrapped weights (`base_layer.weight`), which no plain transformer loads."""
        kept = self.config.get("lora_adapter")
        loose = [name for name in loaded_adapters(self.transformer) if name != kept]
        if loose:
            raise ValueError(
                f"save_pretrained: LoRA adapter(s) {loose} are loaded. Fuse them into the weights first "
                "(`pipe.fuse_lora(); pipe.unload_lora_weights()`), or save them apart with `save_lora_weights`."
            )
        with saved_without_adapter(self.transformer, self.config.get("lora_adapter"), save_directory):
            super().save_pretrained(save_directory, *args, **kwargs)

    @classmethod
    def from_original(  # noqa: PLR0913 (the conversion's options; `rolldiff convert` has a flag for each)
        cls,
        checkpoint: str | os.PathLike,
        base: str | os.PathLike,
        recipe: str | None = None,
        lora: str | os.PathLike | None = None,
        fuse_lora: bool = True,
        use_ema: bool | None = None,
        dtype: torch.dtype | None = None,
        height: int | None = None,
        width: int | None = None,
        torch_dtype: torch.dtype | None = None,
    ):
        """A pipeline from an original checkpoint file (Self-Forcing, LongLive, Causal Forcing, Rolling Forcing,
        StreamDiffusionV2, Krea Realtime, LongSANA) and the diffusers base it was trained from, running its authors'
        recipe by default (`config.recipe`). `save_pretrained` it, or use `rolldiff convert`, for a folder.

        Args:
            checkpoint: the authors' `.pt` / `.pth` (read with `weights_only=True`) or `.safetensors`.
            base: a diffusers Wan 2.1 (`Wan-AI/Wan2.1-T2V-1.3B-Diffusers`) or SANA-Video pipeline folder or Hub id;
                the tokenizer, text encoder and VAE come from it (its transformer weights are never read).
            recipe: one of `rolldiff.list_recipes(...)`; default: detected (the published file name; SANA's one
                recipe; a `lora` means LongLive). Rolling Sink runs on Self-Forcing's file, so it is always named.
            lora: LongLive's `lora.pt` (recipe "longlive" needs it).
            fuse_lora: fuse the adapter into the weights (fastest); False keeps it as the `"longlive"` adapter.
            use_ema: take `generator_ema` (True) or `generator` (False); default: what the authors' loader takes.
            dtype: cast the transformer and text encoder (e.g. `torch.bfloat16`); default: as stored. `torch_dtype`,
                its old name, is taken too (with a FutureWarning), as diffusers does.
            height, width: the native frame size a call uses when it gives none (default 480 x 832).

        Raises:
            ValueError: before anything is built, naming what is wrong: an unknown or LoRA-only file, a recipe of
                another family or one that cannot be told, a base of another family or size, missing keys.
        """
        from ..conversion import pipeline_from_original, plan_conversion

        dtype = resolve_dtype(dtype, torch_dtype)
        plan = plan_conversion(checkpoint, base, recipe=recipe, lora=lora, use_ema=use_ema)
        return pipeline_from_original(cls, plan, dtype, fuse_lora, height, width)

    @property
    def interrupt(self) -> bool:
        """diffusers' stop switch: `pipe.interrupt = True` (e.g. from a callback) stops every stream of this pipeline
        that is running when it is set, before its next step; streams started later are not affected. Reads True
        while one of the running streams is stopped that way. Each stream also has its own `interrupt()`."""
        with self._streams_lock:
            return any(stream.interrupted for stream in self._running_streams)

    @interrupt.setter
    def interrupt(self, value: bool) -> None:
        if not value:
            return  # diffusers resets the flag at each call; here each stream starts with its own, cleared
        with self._streams_lock:
            running = list(self._running_streams)
        for stream in running:
            stream.interrupt()

    def stream_started(self, stream: ChunkStream) -> None:
        """A stream of this pipeline started (`pipe.interrupt = True` reaches it until it ends)."""
        with self._streams_lock:
            self._running_streams.add(stream)

    def stream_ended(self, stream: ChunkStream) -> None:
        with self._streams_lock:
            self._running_streams.discard(stream)

    @property
    def execution_device(self) -> torch.device:
        """Where the models run (diffusers' `_execution_device`: the GPU under model CPU offload)."""
        return self._execution_device

    # ---------------------------------------------------------------------------------------- frame counts
    def frames_to_latent(self, num_frames: int) -> int:
        return (num_frames - 1) // self.vae_scale_factor_temporal + 1

    def latent_to_frames(self, latent_frames: int) -> int:
        return (latent_frames - 1) * self.vae_scale_factor_temporal + 1

    def latent_to_pixel_start(self, latent_frame: int) -> int:
        """First pixel frame decoded from latent frame `latent_frame` (the first latent frame is 1 pixel frame)."""
        return 0 if latent_frame == 0 else (latent_frame - 1) * self.vae_scale_factor_temporal + 1

    def valid_num_frames(
        self, num_frames: int, chunk_frames: int | None = None, first_frame_alone: bool = False
    ) -> tuple[int, int]:
        """The reachable frame counts just below and above `num_frames` for this VAE and chunking.

        `first_frame_alone`: the video starts with one latent frame before its whole chunks (`image_mode="frame"`).
        """
        chunk = chunk_frames or self.config.chunk_frames
        offset = int(first_frame_alone)
        chunks = max(1, (self.frames_to_latent(max(num_frames, 1)) - offset) // chunk)
        return tuple(self.latent_to_frames(offset + n * chunk) for n in (chunks, chunks + 1))

    def check_size(self, name: str, size: Any) -> int:
        """A pixel side (`name` is "height" or "width"): a positive multiple of the VAE factor times the patch."""
        patch = dict(zip(("height", "width"), self.transformer.config.patch_size[1:]))[name]
        factor = self.vae_scale_factor_spatial
        return check_size(name, size, factor * patch, f"VAE factor {factor} x patch {patch}")

    @property
    def callback_tensor_inputs(self) -> tuple[str, ...]:
        """The tensors `callback_on_step_end` may ask for (diffusers' `_callback_tensor_inputs`)."""
        return tuple(self._callback_tensor_inputs)

    # ---------------------------------------------------------------------------------------- the call
    @takes_call_arguments()
    def stream(self, *args: Any, **kwargs: Any) -> ChunkStream:
        """A live generation (`ChunkStream`): iterate it for each chunk's frames as soon as they are made.

        Every argument is checked now (`build_request`), before any model work; the stream starts at its first
        iteration. Each item is what `__call__` returns for those frames: `(batch, frames, H, W, 3)` np in [0, 1]
        for "np", PIL lists, `(batch, frames, 3, H, W)` torch for "pt", or the chunk's latents for "latent". The
        stream also takes `switch_prompt(...)` at chunk boundaries, `interrupt()`, and round-trips through
        `state_dict()`.
        """
        return self._stream_of(VideoCall.bind("stream", args, kwargs))

    def _stream_of(self, call: VideoCall) -> ChunkStream:
        """The stream of a checked call: here, or split over `devices` (`rolldiff.pipelines.parallel`)."""
        request = build_request(self, call)
        if request.devices is None or len(request.devices) == 1:
            return ChunkStream(self, request)
        from ..parallel.launch import parallel_stream  # torch.distributed only when a stream is split

        return parallel_stream(self, call, request)

    def num_frames_for(self, seconds: float, fps: float, **call: Any) -> int:
        """How many frames a call with these arguments makes to last at least `seconds` at `fps`: whole chunks of
        the chunk length the call resolves to (its `chunk_frames`, else its recipe's, else the model's), after one
        latent frame for a start image in the "frame" convention. The CLI, the demo and the evaluation ask here.

        `pipe(prompt, num_frames=pipe.num_frames_for(10, 16, recipe="self-forcing"), recipe="self-forcing")`
        """
        return num_frames_for(self, seconds, fps, VideoCall.bind("num_frames_for", (), call))

    def check_prompt_text(
        self, prompts: list[str], max_sequence_length: int, name: str, require_known_word: bool = True
    ) -> None:
        """Warn about words the tokenizer will not read; refuse a prompt with none it knows (if it must know one)."""
        tokenizer = getattr(self, "tokenizer", None)
        if tokenizer is not None:
            check_prompts(tokenizer, prompts, max_sequence_length, name, require_known_word=require_known_word)

    # ---------------------------------------------------------------------------------------- public API
    @torch.no_grad()
    @takes_call_arguments(extra=(RETURN_DICT,))
    def __call__(self, *args: Any, return_dict: bool = True, **kwargs: Any) -> ChunkedVideoPipelineOutput | tuple:
        """Generate a whole video: the frames of one `stream(...)` with the same arguments, joined.

        Every chunk is decoded by the stream's own causal decoder, so the result equals the stream's items
        frame for frame (and one whole-clip `vae.decode`), and concurrent calls on one pipeline never share
        decoder state. `return_dict=False` returns `(frames,)`.
        """
        call = VideoCall.bind("__call__", args, kwargs)
        stream = self._stream_of(call)
        frames = concat_chunks(list(stream), call.output_type)
        if not return_dict:
            return (frames,)
        return self.output_class(frames=frames)

    def generate_to_file(
        self,
        path: str,
        prompt: str | None = None,
        fps: int = 16,
        *,
        resume: bool = False,
        state_every_s: float = 60.0,
        quality: float = 5,
        on_chunk: Callable[[int], None] | None = None,
        overlay: Callable[[np.ndarray, int], np.ndarray] | None = None,
        **kwargs: Any,
    ) -> int:
        """Stream a video straight into an mp4 at `path` in constant memory; returns the frames in the file.

        Takes the arguments of `stream` (batch size 1). The file appears at `path` only when generation
        succeeds; a failed or interrupted run keeps the frames done as `path`'s partial file (`video.partial.mp4`)
        and never touches an existing file at `path`. Every `state_every_s` seconds (0: every chunk) the run's
        state is saved beside it (`video.resume.safetensors`); `resume=True` continues from there, and the
        resumed video equals an uninterrupted one. `quality` is the encoder's, 1 (smallest file) to 10 (lossless
        with libx264). `on_chunk(frames_written)` runs after each chunk is in the file; an exception raised there
        stops the run as an interrupt does. `overlay(frames, first_frame)` draws on each chunk's frames before they
        are written (a story's subtitles: `subtitle_overlay`). See `rolldiff.pipelines.io.resume.write_video`.
        """
        if kwargs.get("output_type", "np") != "np":
            raise ValueError("`output_type`: `generate_to_file` writes frames itself; do not pass it.")
        stream = self.stream(prompt, **kwargs)  # checks every argument before any work
        return write_video(
            stream, path, fps, resume=resume, state_every_s=state_every_s, quality=quality, on_chunk=on_chunk,
            overlay=overlay,
        )  # fmt: skip

    # ---------------------------------------------------------------------------------------- speed
    def enable_fp8(self) -> bool:
        """float8 weights and activations for the transformer's per-step linear layers (torchao; CUDA, sm 8.9+,
        bf16 weights): `acceleration.enable_fp8`. Apply before compiling. Refused elsewhere, naming why
        (`AccelerationUnavailable`); False when no layer was converted."""
        return enable_fp8(self.transformer)

    def set_attention_backend(self, name: str = "fastest") -> str:
        """Every attention through diffusers' backend `name`, or the fastest the transformer's device offers for
        its head sizes and dtype ("fastest": FA3, flash or SDPA); masked calls fall back to SDPA. Returns the
        backend set. Chosen and checked on one device, the transformer's (`acceleration.set_attention_backend`)."""
        from ..acceleration import attention_head_dims, transformer_device, weights_dtype

        where = (attention_head_dims(self.transformer), weights_dtype(self.transformer))
        chosen = fastest_attention_backend(transformer_device(self.transformer), *where) if name == "fastest" else name
        set_attention_backend(self.transformer, chosen)
        return chosen

    def enable_cuda_graphs(self):
        """Replay the compiled cached step as CUDA graphs (`torch.compile(mode="reduce-overhead", fullgraph=True)`:
        2 graphs, the ring buffers' static addresses); one stream per transformer. Refused off CUDA or under
        offload hooks (`AccelerationUnavailable`)."""
        return capture_cuda_graphs(self.transformer)

    # ---------------------------------------------------------------------------------------- memory
    def enable_offload(self, mode: str = "text-encoder", device: str | torch.device | None = None) -> None:
        """Place the components on `device` (default: the accelerator) so that less of them is there at once, in place
        of `pipe.to(device)` (`rolldiff.pipelines.memory`): `"text-encoder"` (the text encoder visits the GPU for each
        prompt; chunks run at full speed), `"model"` (diffusers' `enable_model_cpu_offload`: each component in turn)
        or `"blocks"` (the transformer too, one block at a time). The video is the resident pipeline's."""
        enable_offload(self, mode, device or get_device())

    def enable_fp8_storage(self) -> None:
        """Keep the transformer's weights in float8 (e4m3), cast to its dtype layer by layer at each call (diffusers'
        layerwise casting): half the weight memory of bfloat16, any GPU; the video changes by that rounding. Call
        after loading LoRAs (`fuse_loras`) and before `enable_offload` or `to(device)`."""
        enable_fp8_storage(self.transformer)

    # ---------------------------------------------------------------------------------------- the loop's pieces
    def branch_embeds(self, request: VideoRequest, prompt_index: int) -> torch.Tensor:
        """The conditional branch's text embeddings for schedule entry `prompt_index`."""
        if prompt_index == 0 and request.prompt_embeds is not None:
            return request.prompt_embeds.to(device=self.execution_device, dtype=self.transformer.dtype)
        return self.encode_prompt(request.schedule.prompts(prompt_index), request.max_sequence_length)

    def set_conditioning(self, cache, embeds: torch.Tensor) -> None:
        """Tell the cache the prompt changed; fill the text K/V now unless offload hooks bring the weights only inside
        the transformer's forward (then the first step fills them, from within it)."""
        cache.reset_cross_attention()
        if not loads_weights_per_call(self.transformer):
            self.transformer.prepare_conditioning(cache, embeds)

    def context_pass(
        self, clean: torch.Tensor, embeds: Sequence[torch.Tensor], caches: Sequence, request, timestep: float = 0.0
    ) -> None:
        """Write the clean chunk's K/V at `timestep` (0; Self-Forcing's `context_noise`) into every branch's cache
        and commit, inside the cache's `context_pass()` (a layer with a context view of its own shows it)."""
        timestep = torch.full((clean.shape[0],), float(timestep), device=clean.device)
        for branch_embeds, cache in zip(embeds, caches):
            with cache.context_pass():
                self.transformer_step(clean, timestep, branch_embeds, cache, request)
                cache.commit()

    def postprocess(self, video: torch.Tensor, output_type: str) -> Any:
        """`(batch, 3, frames, H, W)` in [-1, 1] -> the requested output type."""
        return self.video_processor.postprocess_video(video.float(), output_type=output_type)

    def encode_prompt(self, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
        """Text embeddings `(batch, max_sequence_length, channels)` on the execution device in the transformer's
        dtype, zero past each prompt's end (UMT5 and Gemma encoders alike; see `encode_prompts`)."""
        return encode_prompts(
            self.tokenizer,
            self.text_encoder,
            prompts,
            check_max_sequence_length(max_sequence_length),
            device=self.execution_device,
            dtype=self.transformer.dtype,
        )

    def set_vae_factors(self, vae) -> None:
        """Temporal and spatial compression of the Wan VAE (its `temperal_downsample` flags), and the processor."""
        downsample = getattr(vae.config, "temperal_downsample", [False, True, True]) if vae is not None else None
        self.vae_scale_factor_temporal = 2 ** sum(downsample) if downsample is not None else 4
        self.vae_scale_factor_spatial = 2 ** len(downsample) if downsample is not None else 8
        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor_spatial)

    def cache_device(self, device: torch.device) -> torch.device | None:
        """The execution device; `None` (each block's own device) for a transformer split by `device_map`."""
        device_map = getattr(self.transformer, "hf_device_map", None) or {}
        return None if len(set(device_map.values())) > 1 else device

    # ---------------------------------------------------------------------------------------- family hooks
    def make_layout(
        self, tokens_per_frame: int, options: CacheOptions, num_latent_frames: int, largest_chunk: int | None = None
    ) -> ChunkLayout:
        """The family's cache geometry for a video of `num_latent_frames`, never larger than the video fills;
        `largest_chunk` (latent frames) when the first chunk is longer than `options.chunk_frames`."""
        raise NotImplementedError

    def make_stream_cache(self, request: VideoRequest, dtype: torch.dtype, device: torch.device):
        """One stream's cache for one guidance branch, allocated now (a failure names the settings that size it)."""
        try:
            return self.transformer.make_cache(
                request.layout, request.batch_size, dtype, self.cache_device(device), **self.cache_storage(request)
            )
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not isinstance(error, torch.OutOfMemoryError) and "alloc" not in str(error).lower():
                raise
            layout = request.layout
            raise CacheAllocationError(
                f"The KV cache for `sink_frames`={layout.sink_frames}, `window_frames`={layout.window_frames} "
                f"({layout.context_frames * layout.tokens_per_frame} tokens per block, batch {request.batch_size}) "
                f"does not fit in memory: {str(error).splitlines()[0]} Lower `window_frames` / `sink_frames`, the "
                "frame size or the batch, or store the cache with `kv_quantization` / `kv_offload`."
            ) from None

    def cache_storage(self, request: VideoRequest) -> dict[str, Any]:
        """Keyword arguments of the transformer's `make_cache` beyond the layout (e.g. quantized storage)."""
        return {}

    def make_encoder(self, normalize: bool = True) -> StreamingWanEncoder:
        """A fresh streaming encoder for one stream's start image or input video (its own feature cache); latents
        in the transformer's normalised space unless `normalize=False` (`normalize_input_latents`)."""
        return StreamingWanEncoder(self.vae, normalize=normalize)

    def make_decoder(self):
        """A fresh streaming decoder for one stream: the Wan VAE's causal decoder with a feature cache of its own,
        or the tiny autoencoder's (TAEHV) after `load_tiny_autoencoder`."""
        tiny = getattr(self, "tiny_autoencoder", None)
        if tiny is not None:
            return StreamingTinyDecoder(tiny)  # TAEHV decodes the transformer's latents as they are
        return StreamingWanDecoder(self.vae, denormalize=True)

    def load_tiny_autoencoder(self, path_or_model: str | os.PathLike | TinyVideoAutoencoder | None):
        """Decode with a tiny autoencoder (TAEHV architecture: `taew2_1.pth` / `.safetensors` for Wan 2.1) instead of
        the full VAE: every stream made afterwards decodes through it, about 25x less work per chunk. `None`
        returns to the full VAE. The VAE still encodes start images and input videos. Returns the autoencoder."""
        if path_or_model is None or isinstance(path_or_model, TinyVideoAutoencoder):
            tiny = path_or_model
        else:
            tiny = TinyVideoAutoencoder.from_single_file(path_or_model)
        if tiny is not None:
            channels = self.transformer.config.out_channels
            if tiny.config.latent_channels != channels:
                raise ValueError(
                    f"`path_or_model`: the tiny autoencoder decodes {tiny.config.latent_channels} latent channels, this "
                    f"transformer makes {channels} (taew2_1 is for Wan 2.1's 16)."
                )
            tiny = tiny.to(self.vae.device)
            tiny = (tiny if tiny.dtype == self.vae.dtype else tiny.to(dtype=self.vae.dtype)).eval()
        self.tiny_autoencoder = tiny
        return tiny

    def transformer_step(self, latents, timestep, embeds, cache, request: VideoRequest) -> torch.Tensor:
        """One forward of the chunk through `cache`; returns the velocity."""
        raise NotImplementedError

    def recache_frames(self, layout: ChunkLayout, committed_frames: int, chunk_frames: int) -> int:
        """Clean latent frames to keep for a re-cache after a prompt switch (`chunk_frames`: the chunk just
        committed, which is not every chunk's size when the first takes the leftover frames)."""
        raise NotImplementedError

    def recache(self, recent: torch.Tensor, embeds: torch.Tensor, cache, request: VideoRequest) -> None:
        """Rewrite the recent context under the new prompt (the family's re-cache)."""
        raise NotImplementedError

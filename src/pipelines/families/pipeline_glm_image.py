"""GLM-Image text-to-image and image editing with rolldiff's condition cache.

`GlmImageCachedPipeline` subclasses diffusers' `GlmImagePipeline`: the same components (prior,
processor, glyph encoder, VAE, decoder, scheduler), call arguments, outputs and helpers (prompt
encoding, latents, glyph texts, token upsampling are diffusers' own). It differs where diffusers'
`__call__` cannot be reused piecemeal:
- the reference images' K/V go into a `ConditionKVCache` (read in place at every conditional step,
  no per-step `torch.cat`); a caller may pass one (`condition_cache=`) to reuse its buffers across calls;
- the reference images' prior tokens are computed from the per-image feature maps transformers 5.x
  returns (diffusers 0.42.1 `torch.cat`s them and fails), with no patch on either library;
- bad input is refused before any model runs (sizes, output type, empty prompt, reference batch,
  a condition larger than a given cache).
For the same components and seed it produces diffusers' image (tests/test_glm_image_pipeline.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.pipelines.glm_image.pipeline_glm_image import (
    GlmImagePipeline,
    calculate_shift,
    retrieve_latents,
    retrieve_timesteps,
)
from diffusers.pipelines.glm_image.pipeline_output import GlmImagePipelineOutput
from einops import rearrange

from ...caching.condition import ConditionKVCache
from ...checks import check_choice, check_int
from ...models.glm_image import GlmImageCachedTransformer2DModel

__all__ = ["GlmImageCachedPipeline", "GlmImagePipelineOutput"]

OUTPUT_TYPES = ("pil", "np", "pt", "latent")
_DIFFUSERS_DECODER = ("diffusers", "GlmImageTransformer2DModel")  # what a diffusers GLM-Image folder names
_OUR_DECODER = (GlmImageCachedTransformer2DModel.__module__, GlmImageCachedTransformer2DModel.__name__)


def feature_maps(pooler_output: Sequence[torch.Tensor] | torch.Tensor, grids: torch.Tensor) -> list[torch.Tensor]:
    """The prior's per-image features as `(C, h, w)` maps, whichever form transformers returned.

    transformers 5.x gives a list of `(C, h, w)` maps; earlier 5.0 builds gave flat `(h * w, C)`
    chunks (or one packed tensor), which is what diffusers 0.42.1 still expects.
    """
    if isinstance(pooler_output, torch.Tensor):
        pooler_output = torch.split(pooler_output, (grids[:, 1] * grids[:, 2]).tolist())
    maps = []
    for features, (_, h, w) in zip(pooler_output, grids.tolist()):
        maps.append(features if features.ndim == 3 else rearrange(features, "(h w) c -> c h w", h=h, w=w))
    return maps


@dataclass(frozen=True)
class DecoderConditions:
    """What every denoising step of the decoder is conditioned on (the prompt branches and the prior's tokens)."""

    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None
    prior_token_ids: torch.Tensor
    size: tuple[int, int]
    crops_coords_top_left: tuple[int, int]
    editing: bool = False


class GlmImageCachedPipeline(GlmImagePipeline):
    r"""GLM-Image (autoregressive prior + diffusion decoder) with rolldiff's condition cache.

    Components as diffusers' `GlmImagePipeline`; `transformer` is a `GlmImageCachedTransformer2DModel`
    (`from_pretrained` of a diffusers GLM-Image folder loads it in place of diffusers' decoder class).
    """

    def __init__(
        self,
        tokenizer,
        processor,
        text_encoder,
        vision_language_encoder,
        vae,
        transformer: GlmImageCachedTransformer2DModel,
        scheduler,
    ):
        if not isinstance(transformer, GlmImageCachedTransformer2DModel):
            raise TypeError(
                f"`transformer` must be a GlmImageCachedTransformer2DModel, got {type(transformer).__name__}; load "
                "it with `GlmImageCachedTransformer2DModel.from_pretrained(path, subfolder='transformer')` "
                "(diffusers' GlmImageTransformer2DModel weights load unchanged)."
            )
        super().__init__(tokenizer, processor, text_encoder, vision_language_encoder, vae, transformer, scheduler)

    @classmethod
    def extract_init_dict(cls, config_dict: dict, **kwargs) -> tuple[dict, dict, dict]:
        """`model_index.json`'s components, with diffusers' decoder class swapped for ours.

        diffusers' `from_pretrained` builds every component from the `[library, class]` this returns, so
        the decoder loads through diffusers' own loader, with every argument and per-component rule it
        applies (`dtype` or a per-component dict, `variant`, `device_map`, `quantization_config`, ...).
        A folder we saved already names our class; a decoder passed as `transformer=` is used as given.
        """
        init_dict, unused_kwargs, hidden_dict = super().extract_init_dict(config_dict, **kwargs)
        if list(init_dict.get("transformer") or []) == list(_DIFFUSERS_DECODER):
            init_dict["transformer"] = list(_OUR_DECODER)
        return init_dict, unused_kwargs, hidden_dict

    # ------------------------------------------------------------------------------------ sizes
    @property
    def size_multiple(self) -> int:
        """Target sides must be multiples of this: the prior works at 1/32 (tokens upsampled 2x to the decoder grid)."""
        return self.vae_scale_factor * self.transformer.config.patch_size * 2

    @property
    def token_pixels(self) -> int:
        """Pixels per decoder token side (VAE factor x decoder patch)."""
        return self.vae_scale_factor * self.transformer.config.patch_size

    def _reference_size(self, image: PIL.Image.Image) -> tuple[int, int]:
        """diffusers' rule: reference sides floored to a multiple of the token size."""
        multiple = self.token_pixels
        return (image.height // multiple) * multiple, (image.width // multiple) * multiple

    # ------------------------------------------------------------------------------------ input checks
    @staticmethod
    def _prompt_batch(prompt, prompt_embeds) -> int:
        if isinstance(prompt, str):
            return 1
        if prompt is not None and not isinstance(prompt, list):
            raise TypeError(f"`prompt` must be a str or a list of str, got {type(prompt).__name__}.")
        return len(prompt) if prompt is not None else prompt_embeds.shape[0]

    def _normalize_images(self, image, batch_size: int) -> list[list[PIL.Image.Image]] | None:
        """`image` as one list of reference images per prompt (diffusers' accepted forms), checked."""
        if image is None or (isinstance(image, (list, tuple)) and len(image) == 0):
            return None
        if isinstance(image, PIL.Image.Image):
            image = [image]
        if not isinstance(image, (list, tuple)):
            raise TypeError(f"`image` must be a PIL image or a list of them, got {type(image).__name__}.")
        nested = isinstance(image[0], (list, tuple))
        if not nested:
            if batch_size != 1:
                raise ValueError(
                    f"`image` for {batch_size} prompts must be a list of {batch_size} lists of reference images "
                    f"(one list per prompt), got a flat list of {len(image)} images."
                )
            image = [image]
        if len(image) != batch_size:
            raise ValueError(
                f"`image` has {len(image)} lists of reference images but there are {batch_size} prompts; "
                "pass one list per prompt."
            )
        counts = [len(images) for images in image]
        if len(set(counts)) > 1 or counts[0] == 0:
            raise ValueError(f"every prompt needs the same number (>= 1) of reference images, got {counts}.")
        for images in image:
            for reference in images:
                if not isinstance(reference, PIL.Image.Image):
                    raise TypeError(f"reference images must be PIL images, got {type(reference).__name__}.")
                if min(self._reference_size(reference)) == 0:
                    raise ValueError(
                        f"a reference image of {reference.width}x{reference.height} is smaller than one decoder "
                        f"token ({self.token_pixels} pixels a side)."
                    )
        return [list(images) for images in image]

    def _resolve_size(self, height, width, images) -> tuple[int, int]:
        """diffusers' defaults: the first reference image's size when editing, else the sample size."""
        if images is not None:
            ref_height, ref_width = self._reference_size(images[0][0])
        else:
            ref_height = ref_width = self.default_sample_size * self.vae_scale_factor
        multiple = self.size_multiple
        height = height if height is not None else (ref_height // multiple) * multiple
        width = width if width is not None else (ref_width // multiple) * multiple
        return height, width

    def check_call(
        self, prompt, height, width, output_type, num_images_per_prompt, num_inference_steps, images, prior_inputs
    ) -> None:
        """Checks diffusers' `check_inputs` leaves out; all before any model runs."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if prompt is not None and (len(prompt) == 0 or any(not isinstance(p, str) or not p.strip() for p in prompt)):
            raise ValueError(f"`prompt` must be a non-empty string or a non-empty list of them, got {prompt!r}.")
        multiple = self.size_multiple
        for name, size in (("height", height), ("width", width)):
            if isinstance(size, bool) or not isinstance(size, int) or size < multiple or size % multiple:
                nearest = max(multiple, round(size / multiple) * multiple) if isinstance(size, int) else multiple
                raise ValueError(
                    f"`{name}` must be a positive multiple of {multiple} (VAE factor {self.vae_scale_factor} x "
                    f"decoder patch {self.transformer.config.patch_size} x 2 for the prior's grid), got {size!r}; "
                    f"nearest valid: {nearest}."
                )
        check_choice("output_type", output_type, OUTPUT_TYPES)
        check_int("num_images_per_prompt", num_images_per_prompt, 1)
        check_int("num_inference_steps", num_inference_steps, 1)
        prior_token_ids, prior_token_image_ids, source_image_grid_thw = prior_inputs
        if images is not None and prior_token_ids is not None and prior_token_image_ids is None:
            raise ValueError(
                "editing with `prior_token_ids` also needs `prior_token_image_ids` and `source_image_grid_thw` "
                "(all three come from `generate_prior_tokens`)."
            )

    def glyph_tokens(self, prompt: str | list[str], max_sequence_length: int = 2048) -> int:
        """Glyph tokens `encode_prompt` will give a batch of `prompt`s, counted by the tokenizer alone.

        diffusers' rule: each prompt's quoted texts (or one empty text) are tokenized, each prefixed by one
        pad token when the prompt has an even number of them, and concatenated; prompts are padded to the
        longest. Lets the cache capacity be checked before the prior runs, without running the encoder.
        """
        lengths = []
        for texts in self.get_glyph_texts(prompt):
            texts = texts or [""]
            ids = self.tokenizer(texts, max_length=max_sequence_length, truncation=True).input_ids
            lengths.append(sum(len(text_ids) for text_ids in ids) + len(ids) * ((len(ids) + 1) % 2))
        return max(lengths)

    def condition_tokens(self, images: list[list[PIL.Image.Image]] | None) -> list[int]:
        """Decoder tokens of each prompt's reference images (what the condition cache holds per sample)."""
        if images is None:
            return []
        return [sum(h * w for h, w in map(self._reference_size, refs)) // self.token_pixels**2 for refs in images]

    # ------------------------------------------------------------------------------------ prior
    def condition_prior_tokens(self, pixel_values: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """Prior (VQ) tokens of the reference images `(sum of h * w,)` at the prior's 1/32 grid."""
        prior = self.vision_language_encoder
        features = prior.get_image_features(pixel_values, grids).pooler_output
        return prior.get_image_tokens(feature_maps(features, grids), grids)

    def generate_prior_tokens(self, prompt, height, width, image=None, device=None, generator=None):
        """diffusers' `generate_prior_tokens` (same inputs, outputs and seeding), working with transformers 5.x."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        batch_size = len(prompts)
        messages = []
        for index, text in enumerate(prompts):
            content = [{"type": "image", "image": reference} for reference in (image[index] if image else [])]
            messages.append([{"role": "user", "content": [*content, {"type": "text", "text": text}]}])
        inputs = self.processor.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            processor_kwargs=dict(padding=batch_size > 1, target_h=height, target_w=width),
        ).to(device)
        grids = inputs["image_grid_thw"]  # per sample: [references..., target grid(s)]
        num_references = len(image[0]) if image else 0
        grids_per_sample = int(inputs["images_per_sample"][0]) if "images_per_sample" in inputs else grids.shape[0]
        max_new_tokens, target_offset, token_h, token_w = self._compute_generation_params(
            grids[:grids_per_sample], is_text_to_image=not image
        )

        image_ids_per_sample = grids_per_sample_out = None
        if image:
            source = torch.cat(
                [grids[s * grids_per_sample : s * grids_per_sample + num_references] for s in range(batch_size)]
            )
            tokens_d32 = self.condition_prior_tokens(inputs["pixel_values"], source)
            upsampled = [
                self._upsample_token_ids(ids, h, w).squeeze(0)
                for ids, (_, h, w) in zip(torch.split(tokens_d32, source.prod(-1).tolist()), source.tolist())
            ]
            source_up = source.clone()
            source_up[:, 1:] *= 2
            grids_per_sample_out = list(torch.split(source_up, num_references))
            image_ids_per_sample = [
                torch.cat(upsampled[s * num_references : (s + 1) * num_references]) for s in range(batch_size)
            ]

        if generator is not None:  # transformers' generate takes no generator: diffusers seeds the global RNG
            torch.manual_seed(generator.initial_seed())
            if device is not None and torch.device(device).type == "cuda":
                torch.cuda.manual_seed(generator.initial_seed())
        outputs = self.vision_language_encoder.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True)
        input_length = inputs["input_ids"].shape[-1]  # left padding: generation starts here for every sample
        prior_token_ids = torch.cat(
            [
                self._upsample_token_ids(
                    self._extract_large_image_tokens(
                        outputs[s : s + 1], input_length, target_offset, token_h * token_w
                    ),
                    token_h,
                    token_w,
                )
                for s in range(batch_size)
            ]
        )
        return prior_token_ids, image_ids_per_sample, grids_per_sample_out

    # ------------------------------------------------------------------------------------ decoder
    def _latent_stats(self, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.vae.config.latent_channels, 1, 1)
        mean = torch.tensor(self.vae.config.latents_mean).view(shape).to(device=device, dtype=dtype)
        std = torch.tensor(self.vae.config.latents_std).view(shape).to(device=device, dtype=dtype)
        return mean, std

    def write_conditions(
        self,
        cache: ConditionKVCache,
        images: list[list[PIL.Image.Image]],
        prior_ids_per_sample: list[torch.Tensor],
        grids_per_sample: list[torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        generator=None,
        attention_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Run each reference image once at t = 0 in "write" mode (batch 1), one sample after another."""
        mean, std = self._latent_stats(device, dtype)
        cache.set_mode("write")
        for references, prior_ids, grids in zip(images, prior_ids_per_sample, grids_per_sample):
            for reference, image_prior_ids in zip(references, torch.split(prior_ids, grids.prod(-1).tolist())):
                height, width = self._reference_size(reference)
                pixels = self.image_processor.preprocess(reference, height=height, width=width)
                pixels = pixels.to(device=device, dtype=dtype)
                latent = retrieve_latents(self.vae.encode(pixels), generator=generator, sample_mode="argmax")
                self.transformer(
                    hidden_states=(latent - mean) / std,
                    encoder_hidden_states=torch.zeros(
                        1, 0, self.transformer.config.text_embed_dim, device=device, dtype=dtype
                    ),
                    prior_token_id=image_prior_ids,
                    prior_token_drop=torch.zeros_like(image_prior_ids, dtype=torch.bool),
                    timestep=torch.zeros((1,), device=device),
                    target_size=torch.tensor([pixels.shape[-2:]], device=device),
                    crop_coords=torch.zeros((1, 2), device=device),
                    attention_kwargs=attention_kwargs,
                    kv_caches=cache,
                )
            cache.next_sample()

    def prepare_timesteps(self, height, width, num_inference_steps, timesteps, sigmas, device):
        """diffusers' schedule: integer timesteps from 1000 down, resolution-shifted."""
        image_seq_len = (height // self.vae_scale_factor) * (width // self.vae_scale_factor)
        image_seq_len //= self.transformer.config.patch_size**2
        if timesteps is None:
            timesteps = np.linspace(self.scheduler.config.num_train_timesteps, 1.0, num_inference_steps + 1)[:-1]
        timesteps = np.asarray(timesteps).astype(np.int64).astype(np.float32)
        sigmas = timesteps / self.scheduler.config.num_train_timesteps if sigmas is None else sigmas
        mu = calculate_shift(
            image_seq_len,
            self.scheduler.config.get("base_image_seq_len", 256),
            self.scheduler.config.get("base_shift", 0.25),
            self.scheduler.config.get("max_shift", 0.75),
        )
        return retrieve_timesteps(self.scheduler, num_inference_steps, device, timesteps, sigmas, mu=mu)

    # ------------------------------------------------------------------------------------ call
    @torch.no_grad()
    def __call__(  # noqa: PLR0913 (diffusers' GlmImagePipeline signature)
        self,
        prompt: str | list[str] | None = None,
        image: PIL.Image.Image | list[PIL.Image.Image] | list[list[PIL.Image.Image]] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 50,
        timesteps: list[int] | None = None,
        sigmas: list[float] | None = None,
        guidance_scale: float = 1.5,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        prior_token_ids: torch.Tensor | None = None,
        prior_token_image_ids: list[torch.Tensor] | None = None,
        source_image_grid_thw: list[torch.Tensor] | None = None,
        crops_coords_top_left: tuple[int, int] = (0, 0),
        output_type: str = "pil",
        return_dict: bool = True,
        attention_kwargs: dict[str, Any] | None = None,
        callback_on_step_end: Callable[[Any, int, Any, dict], dict]
        | PipelineCallback
        | MultiPipelineCallbacks
        | None = None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],  # noqa: B006  diffusers' signature
        max_sequence_length: int = 2048,
        condition_cache: ConditionKVCache | None = None,
    ) -> GlmImagePipelineOutput | tuple:
        """Generate (no `image`) or edit (`image`: reference image(s), one list per prompt) an image.

        Arguments as diffusers' `GlmImagePipeline.__call__`, plus `condition_cache`: a
        `ConditionKVCache` to hold the reference images' K/V (its buffers are kept for the next
        call; one with `max_tokens` refuses references that do not fit, before any work).
        Returns `GlmImagePipelineOutput(images=...)` (`output_type` "pil" | "np" | "pt" | "latent").
        """
        if isinstance(callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs

        # 1. Check inputs, all before any model runs
        if prompt is None and prompt_embeds is None:
            raise ValueError("Provide `prompt` (or `prompt_embeds` with `prior_token_ids`).")
        batch_size = self._prompt_batch(prompt, prompt_embeds)
        images = self._normalize_images(image, batch_size)
        height, width = self._resolve_size(height, width, images)
        prior_inputs = (prior_token_ids, prior_token_image_ids, source_image_grid_thw)
        self.check_call(
            prompt, height, width, output_type, num_images_per_prompt, num_inference_steps, images, prior_inputs
        )
        self.check_inputs(
            prompt,
            height,
            width,
            callback_on_step_end_tensor_inputs,
            prompt_embeds,
            negative_prompt_embeds,
            *prior_inputs,
            images,
        )
        if condition_cache is not None and not isinstance(condition_cache, ConditionKVCache):
            raise TypeError(f"`condition_cache` must be a ConditionKVCache, got {type(condition_cache).__name__}.")
        self._guidance_scale = guidance_scale
        self._attention_kwargs = attention_kwargs
        self._current_timestep = None
        self._interrupt = False
        device = self._execution_device
        if condition_cache is None:  # rows that repeat a sample would repeat its conditions in every block
            condition_cache = self.transformer.make_cache(shared_workspace=num_images_per_prompt > 1)
        cache = condition_cache
        # 2. The cache's capacity (glyph tokens counted by the tokenizer alone), before the prior runs
        image_tokens = (height // self.token_pixels) * (width // self.token_pixels)
        if prompt_embeds is not None:
            glyph_tokens = prompt_embeds.shape[1]
        else:
            glyph_tokens = self.glyph_tokens(prompt, max_sequence_length)
        cache.check_fits(
            self.condition_tokens(images), glyph_tokens + image_tokens, batch_size * num_images_per_prompt
        )

        # 3. Prior tokens (the autoregressive prior, which reseeds the global generator), unless given; then the
        #    glyph embeddings: diffusers' order, so dropout in training mode draws the same numbers
        if prior_token_ids is None:
            prior_token_ids, prior_token_image_ids, source_image_grid_thw = self.generate_prior_tokens(
                prompt, height, width, image=images, device=device,
                generator=generator[0] if isinstance(generator, list) else generator,
            )  # fmt: skip
        prompt_embeds, negative_prompt_embeds = self.encode_prompt(
            prompt,
            self.do_classifier_free_guidance,
            num_images_per_prompt=num_images_per_prompt,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            max_sequence_length=max_sequence_length,
            device=device,
            dtype=self.dtype,
        )

        # 4. Latents; the reference images' K/V into the condition cache (batch 1 per sample)
        latents = self.prepare_latents(
            batch_size * num_images_per_prompt,
            self.transformer.config.in_channels,
            height,
            width,
            prompt_embeds.dtype,
            device,
            generator,
            latents,
        )
        cache.clear()
        if images is not None:
            self.write_conditions(
                cache, images, prior_token_image_ids, source_image_grid_thw, prompt_embeds.dtype, device, generator,
                attention_kwargs,
            )  # fmt: skip

        # 5. Denoise: conditional pass reads the conditions, unconditional pass skips them
        timesteps, num_inference_steps = self.prepare_timesteps(
            height, width, num_inference_steps, timesteps, sigmas, device
        )
        self._num_timesteps = len(timesteps)
        conditions = DecoderConditions(
            prompt_embeds, negative_prompt_embeds, prior_token_ids.repeat_interleave(num_images_per_prompt, dim=0),
            (height, width), crops_coords_top_left, editing=images is not None,
        )  # fmt: skip
        latents = self._denoise(
            latents, timesteps, num_inference_steps, cache, conditions, callback_on_step_end,
            callback_on_step_end_tensor_inputs,
        )  # fmt: skip
        self._current_timestep = None
        cache.clear()

        # 6. Decode
        if output_type == "latent":
            images_out = latents
        else:
            mean, std = self._latent_stats(latents.device, self.vae.dtype)
            decoded = self.vae.decode(latents.to(self.vae.dtype) * std + mean, return_dict=False, generator=generator)[
                0
            ]
            images_out = self.image_processor.postprocess(decoded, output_type=output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (images_out,)
        return GlmImagePipelineOutput(images=images_out)

    def _denoise(
        self, latents, timesteps, num_inference_steps, cache, conditions: DecoderConditions, callback_on_step_end,
        callback_tensor_inputs,
    ) -> torch.Tensor:  # fmt: skip
        prompt_embeds, negative_prompt_embeds = conditions.prompt_embeds, conditions.negative_prompt_embeds
        prior_token_ids, size, editing = conditions.prior_token_ids, conditions.size, conditions.editing
        crops_coords_top_left = conditions.crops_coords_top_left
        batch = latents.shape[0]
        device, dtype = latents.device, prompt_embeds.dtype
        target_size = torch.tensor([size], dtype=dtype, device=device).repeat(batch, 1)
        crop_coords = torch.tensor([crops_coords_top_left], dtype=dtype, device=device).repeat(batch, 1)
        drop_cond = torch.zeros_like(prior_token_ids, dtype=torch.bool)
        drop_uncond = torch.ones_like(prior_token_ids, dtype=torch.bool)
        warmup = max(len(timesteps) - num_inference_steps * self.scheduler.order, 0)

        def predict(embeds, drop, mode):
            if editing:
                cache.set_mode(mode)
            return self.transformer(
                hidden_states=latents.to(self.transformer.dtype),
                encoder_hidden_states=embeds,
                prior_token_id=prior_token_ids,
                prior_token_drop=drop,
                timestep=t.expand(batch) - 1,
                target_size=target_size,
                crop_coords=crop_coords,
                attention_kwargs=self.attention_kwargs,
                return_dict=False,
                kv_caches=cache,
            )[0].float()

        with self.progress_bar(total=num_inference_steps) as progress_bar:
            for i, t in enumerate(timesteps):
                if self.interrupt:
                    continue
                self._current_timestep = t
                noise_pred = predict(prompt_embeds, drop_cond, "read")
                if self.do_classifier_free_guidance:
                    noise_uncond = predict(negative_prompt_embeds, drop_uncond, "skip")
                    noise_pred = noise_uncond + self.guidance_scale * (noise_pred - noise_uncond)
                latents = self.scheduler.step(noise_pred, t, latents, return_dict=False)[0]
                if callback_on_step_end is not None:
                    named = {"latents": latents, "prompt_embeds": prompt_embeds}
                    outputs = callback_on_step_end(
                        self, i, self.scheduler.sigmas[i], {k: named[k] for k in callback_tensor_inputs}
                    )
                    latents = outputs.pop("latents", latents)
                    prompt_embeds = outputs.pop("prompt_embeds", prompt_embeds)
                if i == len(timesteps) - 1 or ((i + 1) > warmup and (i + 1) % self.scheduler.order == 0):
                    progress_bar.update()
        return latents

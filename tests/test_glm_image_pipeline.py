"""GlmImageCachedPipeline against diffusers' GlmImagePipeline on the same tiny components and seed.

diffusers' side gets the one allowed patch (`PooledPriorForDiffusers`, see glm_tiny_components.py)
so its editing path runs with transformers 5.x; ours runs the unpatched prior. Images are compared
with a tolerance of 1e-6 (they come out bitwise equal).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import GlmImagePipeline, GlmImageTransformer2DModel
from glm_tiny_components import DECODER_CONFIG, reference_image, tiny_components, tiny_pipelines

from rolldiff import ConditionKVCache, GlmImageCachedPipeline, GlmImageCachedTransformer2DModel

SIZE = dict(height=32, width=32)


@pytest.fixture(scope="module")
def pipelines() -> tuple[GlmImageCachedPipeline, GlmImagePipeline]:
    return tiny_pipelines()


def generate(pipe, steps: int = 2, **kwargs) -> np.ndarray:
    kwargs = {**SIZE, "num_inference_steps": steps, "output_type": "np", **kwargs}
    return pipe(generator=torch.Generator().manual_seed(0), **kwargs).images


def prior_tokens(batch: int = 1) -> torch.Tensor:
    """Decoder-grid prior tokens for a 32x32 image ((32/16) * (32/16) per sample)."""
    return torch.randint(0, 32, (batch, 4), generator=torch.Generator().manual_seed(1))


def assert_same(ours: np.ndarray, theirs: np.ndarray) -> None:
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


def test_text_to_image_equals_diffusers(pipelines):
    ours, theirs = pipelines
    image = generate(ours, prompt="a red cat")  # CFG 1.5, the prior generates its tokens
    assert_same(image, generate(theirs, prompt="a red cat"))
    assert image.shape == (1, 32, 32, 3) and image.std() > 0


@pytest.mark.parametrize("guidance_scale", [1.5, 1.0])
def test_editing_with_two_references_equals_diffusers(pipelines, guidance_scale):
    ours, theirs = pipelines
    references = [reference_image(32, 32, seed=1), reference_image(64, 32, seed=2)]
    kwargs = dict(prompt="make it blue", image=references, guidance_scale=guidance_scale)
    image = generate(ours, **kwargs)
    assert_same(image, generate(theirs, **kwargs))
    other = generate(ours, **{**kwargs, "image": [reference_image(32, 32, seed=3), references[1]]})
    assert np.abs(image - other).max() > 1e-3  # the references reach the decoder


def test_training_mode_first_call_equals_diffusers():
    """Dropout draws from the global generator, which the prior reseeds: the draws must come in diffusers' order."""
    ours, theirs = tiny_pipelines()
    for pipe in (ours, theirs):
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.train()
    assert ours.text_encoder.config.dropout_rate > 0  # the glyph encoder's dropout is live
    images = []
    for pipe in (ours, theirs):
        torch.manual_seed(123)  # the same global state before the call
        images.append(generate(pipe, steps=1, prompt="a 'red' cat"))
    assert_same(*images)


def test_editing_with_num_images_per_prompt_equals_diffusers(pipelines):
    """One sample's conditions written at batch 1, read by a batch of 2."""
    ours, theirs = pipelines
    kwargs = dict(prompt="make it blue", image=[reference_image(32, 64, seed=4)], num_images_per_prompt=2)
    image = generate(ours, **kwargs)
    assert image.shape == (2, 32, 32, 3)
    assert_same(image, generate(theirs, **kwargs))


def test_given_prior_tokens_and_embeddings_equal_diffusers(pipelines):
    ours, theirs = pipelines
    kwargs = dict(prompt="a dog", prior_token_ids=prior_tokens(), num_inference_steps=3)
    assert_same(generate(ours, **kwargs), generate(theirs, **kwargs))


def test_references_of_different_sizes_per_prompt_equal_each_prompt_alone(pipelines):
    """diffusers cannot batch prompts whose references differ in token count; ours masks the gap."""
    ours, theirs = pipelines
    prompts, references = ["make it blue"] * 2, [[reference_image(32, 32, seed=1)], [reference_image(64, 32, seed=2)]]
    prior = ours.generate_prior_tokens(
        prompts, 32, 32, references, torch.device("cpu"), torch.Generator().manual_seed(0)
    )
    latents = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(3))
    kwargs = dict(**SIZE, num_inference_steps=2, output_type="np")
    given = dict(prior_token_ids=prior[0], prior_token_image_ids=prior[1], source_image_grid_thw=prior[2])
    batch = ours(prompts, image=references, latents=latents, **given, **kwargs).images
    for s in range(2):
        alone = {k: v[s : s + 1] for k, v in given.items()}
        image = ours(prompts[s], image=references[s], latents=latents[s : s + 1], **alone, **kwargs).images
        np.testing.assert_allclose(batch[s], image[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        theirs(prompts, image=references, latents=latents, **given, **kwargs)


@pytest.mark.parametrize(
    "prompt",
    ["a cat", "a 'red' cat", "'a' \"b\" 'c' cat", ["a cat", "the 'big' \u201cred\u201d dog"], "'" + "x" * 40 + "'"],
)
def test_glyph_tokens_counts_what_encode_prompt_gives(pipelines, prompt):
    """The cache capacity is checked from the tokenizer alone, before the prior and the glyph encoder run."""
    ours, _ = pipelines
    embeds, _ = ours.encode_prompt(prompt, False, max_sequence_length=16, device=torch.device("cpu"))
    assert ours.glyph_tokens(prompt, max_sequence_length=16) == embeds.shape[1]


def test_reused_condition_cache_gives_the_same_image(pipelines):
    ours, _ = pipelines
    cache = ConditionKVCache(DECODER_CONFIG["num_layers"])
    kwargs = dict(prompt="make it blue", image=[reference_image(seed=5)], condition_cache=cache)
    first = generate(ours, **kwargs)
    pointers = [layer.keys.data_ptr() for layer in cache]
    assert_same(generate(ours, **kwargs), first)
    assert [layer.keys.data_ptr() for layer in cache] == pointers
    assert_same(first, generate(ours, **{**kwargs, "condition_cache": None}))


def test_callbacks_interrupt_and_output_types(pipelines):
    ours, _ = pipelines
    seen = []

    def stop_after_first(pipe, step, timestep, tensors):
        seen.append((step, tuple(tensors)))
        pipe._interrupt = True
        return {"latents": tensors["latents"] * 0}

    base = dict(prompt="a dog", prior_token_ids=prior_tokens(), num_inference_steps=3)
    latents = generate(ours, **base, output_type="latent", callback_on_step_end=stop_after_first)
    assert seen == [(0, ("latents",))] and latents.shape == (1, 4, 4, 4) and latents.abs().max() == 0
    assert generate(ours, **base, output_type="pt").shape == (1, 3, 32, 32)
    assert generate(ours, **base, output_type="pil")[0].size == (32, 32)
    (images,) = ours(**base, **SIZE, output_type="np", return_dict=False)
    assert images.shape == (1, 32, 32, 3)


def test_model_cpu_offload_gives_the_same_image():
    pipe = GlmImageCachedPipeline(**tiny_components())
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt="make it blue", image=[reference_image(seed=6)])
    expected = generate(pipe, **kwargs)
    pipe.enable_model_cpu_offload(device="cpu")
    assert_same(generate(pipe, **kwargs), expected)


def test_save_and_load_round_trip(tmp_path):
    components = tiny_components()
    diffusers_pipe = GlmImagePipeline(**{**components, "transformer": GlmImageTransformer2DModel(**DECODER_CONFIG)})
    diffusers_pipe.transformer.load_state_dict(components["transformer"].state_dict())
    diffusers_pipe.save_pretrained(tmp_path / "diffusers")  # a diffusers GLM-Image folder
    loaded = GlmImageCachedPipeline.from_pretrained(tmp_path / "diffusers")
    assert type(loaded.transformer) is GlmImageCachedTransformer2DModel
    loaded.save_pretrained(tmp_path / "ours")
    index = json.loads((tmp_path / "ours" / "model_index.json").read_text())
    assert index["transformer"] == ["rolldiff.models.glm_image", "GlmImageCachedTransformer2DModel"]
    again = GlmImageCachedPipeline.from_pretrained(tmp_path / "ours")
    original = GlmImageCachedPipeline(**components)
    kwargs = dict(prompt="make it blue", image=[reference_image(seed=7)])
    for pipe in (loaded, again, original):
        pipe.set_progress_bar_config(disable=True)
    expected = generate(original, **kwargs)
    # The loaded weights are bit for bit the originals, but safetensors may place one at an address that is not
    # 64-byte aligned, and the CPU GEMM then sums in another order: 1.7e-6 measured in the prior's vision tower
    # (transformers 5.24, safetensors 0.8), where the in-memory pipelines above agree bitwise.
    np.testing.assert_allclose(generate(loaded, **kwargs), expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(generate(again, **kwargs), expected, rtol=0, atol=1e-5)
    assert np.abs(generate(again, prompt="make it red", image=[reference_image(seed=8)]) - expected).max() > 1e-3


class NoWork:
    """Counts forwards of every model component, and refuses the prior's `generate`."""

    def __init__(self, pipe, monkeypatch):
        self.calls = 0
        self.hooks = [
            getattr(pipe, name).register_forward_pre_hook(self.count)
            for name in ("text_encoder", "vision_language_encoder", "vae", "transformer")
        ]
        monkeypatch.setattr(pipe.vision_language_encoder, "generate", self.refuse)

    def count(self, *_):
        self.calls += 1

    def refuse(self, *_, **__):
        raise AssertionError("the prior ran before the input was checked")


def allocated_cache(batch_size: int) -> ConditionKVCache:
    cache = ConditionKVCache(DECODER_CONFIG["num_layers"], max_tokens=64)
    heads, head_dim = DECODER_CONFIG["num_attention_heads"], DECODER_CONFIG["attention_head_dim"]
    cache.early_initialization(batch_size, heads, head_dim, torch.float32, "cpu")
    return cache


BAD_INPUTS = {
    "reference batch != prompt batch": (
        dict(prompt=["a cat", "a dog"], image=[[reference_image()]]),
        ValueError,
        "`image` has 1 lists of reference images but there are 2 prompts",
    ),
    "flat references for two prompts": (
        dict(prompt=["a cat", "a dog"], image=[reference_image(), reference_image()]),
        ValueError,
        "one list per prompt",
    ),
    "height not a multiple": (
        dict(prompt="a cat", height=40),
        ValueError,
        "`height` must be a positive multiple of 32",
    ),
    "width not a multiple": (dict(prompt="a cat", width=48), ValueError, "`width` .* got 48; nearest valid: 64"),
    "unknown output type": (dict(prompt="a cat", output_type="jpg"), ValueError, "`output_type` must be one of"),
    "empty prompt": (dict(prompt=""), ValueError, "`prompt` must be a non-empty string"),
    "blank prompt in a list": (dict(prompt=["a cat", "  "]), ValueError, "`prompt` must be a non-empty"),
    "no prompt": (dict(prompt=None), ValueError, "Provide `prompt`"),
    "num_images_per_prompt 0": (dict(prompt="a cat", num_images_per_prompt=0), ValueError, "num_images_per_prompt"),
    "reference not an image": (dict(prompt="a cat", image=[np.zeros((32, 32, 3))]), TypeError, "PIL images"),
    "reference smaller than a token": (
        dict(prompt="a cat", image=[reference_image(8, 32)]),
        ValueError,
        "smaller than one decoder token",
    ),
    "condition larger than the cache": (
        dict(prompt="a cat", image=[reference_image(64, 64)], condition_cache=ConditionKVCache(1, max_tokens=16)),
        ValueError,
        "16 condition tokens \\+ 5 current tokens = 21",
    ),
    "batch larger than an allocated cache": (
        dict(prompt="a cat", image=[reference_image()], num_images_per_prompt=3, condition_cache=allocated_cache(2)),
        ValueError,
        "batch 3 exceeds the `batch_size`=2",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_refused_before_any_model_runs(pipelines, monkeypatch, case):
    ours, _ = pipelines
    kwargs, error, message = BAD_INPUTS[case]
    guard = NoWork(ours, monkeypatch)
    with pytest.raises(error, match=message):
        ours(**{**SIZE, **kwargs})
    for hook in guard.hooks:
        hook.remove()
    assert guard.calls == 0


def test_a_diffusers_decoder_is_refused_with_the_fix():
    components = tiny_components()
    components["transformer"] = GlmImageTransformer2DModel(**DECODER_CONFIG)
    with pytest.raises(TypeError, match="GlmImageCachedTransformer2DModel.from_pretrained"):
        GlmImageCachedPipeline(**components)


def load_example():
    path = Path(__file__).parents[1] / "examples" / "glm_image.py"
    spec = importlib.util.spec_from_file_location("glm_image_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_example_edits_with_a_checkpoint_folder(tmp_path):
    GlmImageCachedPipeline(**tiny_components()).save_pretrained(tmp_path / "model")
    reference_image(32, 64, seed=8).save(tmp_path / "reference.png")
    out = tmp_path / "out" / "edited.png"
    argv = ["--model", str(tmp_path / "model"), "--prompt", "make it blue", "--out", str(out)]
    argv += ["--image", str(tmp_path / "reference.png"), "--steps", "2", "--dtype", "float32", "--device", "cpu"]
    assert load_example().main(argv) == out
    assert PIL.Image.open(out).size == (64, 32)  # the reference's size by default
    with pytest.raises(SystemExit, match="no model_index.json"):
        load_example().main(["--model", str(tmp_path), "--prompt", "a cat"])

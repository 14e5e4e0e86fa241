"""The pipelines' `recipe=` against the goldens recorded from the authors' code (tests/goldens/, tools/record_*).

Each test builds the pipeline on the golden's tiny weights (upstream key layout, through our converter), feeds the
recorded text embeddings and hands the stream the noise upstream drew, in upstream's order, then asserts that every
chunk's clean latents equal upstream's within 1e-4 (the floor, upstream fp32 vs upstream fp64, is printed).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.schedulers import scheduling_flow_match_euler_discrete as scheduler_module
from recipe_goldens import (
    Golden,
    InjectedNoise,
    assert_switch_seen,
    chunk_errors,
    inject_noise,
    load_golden,
    load_transformer,
    load_vae,
    switched_stream,
)
from tiny_components import tiny_text_encoder, tiny_vae, word_tokenizer

from rolldiff import KreaRealtimeVideoPipeline, LongSanaVideoPipeline
from rolldiff.pipelines import stream as stream_module
from rolldiff.recipes import describe_recipe, get_recipe, list_recipes
from rolldiff.training.sana_components import SanaTinyConfig, build_gemma_text_encoder, build_gemma_tokenizer

TOLERANCE = 1e-4


# ----------------------------------------------------------------------------------------- LongSANA
def _longsana_pipeline(golden: Golden) -> LongSanaVideoPipeline:
    transformer = load_transformer("longsana")
    tokenizer = build_gemma_tokenizer()
    text_encoder = build_gemma_text_encoder(
        SanaTinyConfig(text_dim=transformer.config.caption_channels), len(tokenizer)
    )
    height, width = (4 * side for side in golden.meta["latent_size"])  # the tiny VAE's factor 4
    pipe = LongSanaVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer,
        vae=tiny_vae(temporal=False),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # the recipe's own shift (7) must win
        max_sequence_length=golden.meta["settings"]["text_len"],
        height=height,
        width=width,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("scenario", ["plain", "switch_early", "switch_late"])
@torch.no_grad()
def test_longsana_recipe_matches_upstream(scenario, monkeypatch):
    golden = load_golden("longsana", scenario)
    pipe = _longsana_pipeline(golden)
    noise = InjectedNoise(golden, steps=len(get_recipe("longsana").settings["denoising_steps"]))
    monkeypatch.setattr(stream_module, "randn_tensor", noise)
    monkeypatch.setattr(scheduler_module, "randn_tensor", noise)
    prompts = golden.settings["chunk_prompts"]
    stream = pipe.stream(
        num_frames=golden.meta["latent_frames"], prompt_embeds=golden.text[prompts[0]], output_type="latent",
        recipe="longsana",
    )  # fmt: skip
    chunks = []
    for index in range(stream.num_chunks):
        if index and prompts[index] != prompts[index - 1]:
            stream.switch_prompt(prompt_embeds=golden.text[prompts[index]])
        chunks.append(next(stream))
    errors = chunk_errors(golden, chunks)
    print(f"\nlongsana/{scenario} through the pipeline: {[f'{e:.1e}' for e in errors]}, floor {golden.floor:.1e}")
    assert noise.noise.exhausted
    assert max(errors) <= TOLERANCE, errors


# ----------------------------------------------------------------------------------------- the registry
def test_every_recipe_names_its_pipeline_upstream_and_settings():
    assert set(list_recipes()) == {
        "self-forcing", "longlive", "krea-realtime", "longsana", "causal-forcing", "causal-forcing-framewise",
        "causal-forcing-2step", "causal-forcing-1step", "rolling-sink", "streamdiffusionv2", "rolling-forcing",
        "infinity-rope", "reward-forcing",
    }  # fmt: skip
    assert list_recipes("LongSanaVideoPipeline") == ["longsana"]
    for name in list_recipes():
        text = describe_recipe(name)
        assert get_recipe(name).upstream in text and "denoising_steps" in text


def test_a_recipe_of_another_pipeline_is_refused_by_name(monkeypatch):
    golden = load_golden("longsana", "plain")
    pipe = _longsana_pipeline(golden)
    with pytest.raises(ValueError, match=r"`recipe` must be one of \['longsana'\]"):
        pipe.stream(num_frames=53, prompt_embeds=golden.text["a"], recipe="krea-realtime")


def test_explicit_arguments_override_the_recipe_and_a_folder_may_name_one(tmp_path):
    golden = load_golden("longsana", "plain")
    pipe = _longsana_pipeline(golden)
    request = pipe.stream(num_frames=53, prompt_embeds=golden.text["a"], recipe="longsana").request
    assert request.geometry.first_chunk == 13 and request.step_plan.timesteps == (1000.0, 960.0, 889.0, 727.0)
    assert request.step_plan.sigmas[1] == pytest.approx(0.959957, abs=1e-6)
    overridden = pipe.stream(
        num_frames=50, prompt_embeds=golden.text["a"], recipe="longsana", denoising_steps=[1000, 500]
    ).request
    assert overridden.step_plan.steps == (1000.0, 500.0) and overridden.geometry.first_chunk == 10
    pipe.register_to_config(recipe="longsana")
    pipe.save_pretrained(tmp_path)
    loaded = LongSanaVideoPipeline.from_pretrained(tmp_path)
    assert loaded.stream(num_frames=53, prompt_embeds=golden.text["a"]).request.recipe == "longsana"


# ----------------------------------------------------------------------------------------- Krea-like recipes
def krea_golden_pipeline(
    golden: Golden, transformer=None, vae_recipe: str = "krea-realtime"
) -> KreaRealtimeVideoPipeline:
    """The Krea-like pipeline on a golden's tiny transformer (its recipe's, unless given) and a recipe's tiny VAE, at
    the golden's frame size, with a scheduler shift the recipe must override."""
    pipe = KreaRealtimeVideoPipeline(
        tokenizer=word_tokenizer(),
        text_encoder=tiny_text_encoder(),
        transformer=load_transformer(golden.recipe) if transformer is None else transformer,
        vae=load_vae(vae_recipe),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # the recipe's own shift (5) must win
        max_sequence_length=golden.meta["settings"]["text_len"],
    )
    factor = pipe.vae_scale_factor_spatial
    pipe.register_to_config(
        height=golden.meta["latent_size"][0] * factor, width=golden.meta["latent_size"][1] * factor
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


KREA_LIKE = {
    "self-forcing/no_warp": dict(sigma_mapping="table"),  # warp_denoising_step: false
    "self-forcing/context_noise": dict(context_noise=100),
    "longlive/plain": {},
    "longlive/prompt_switch": {},  # one unmasked re-cache pass: an early switch (frame 6) and a late one (18)
    "krea-realtime/keep_first_frame": dict(recompute_first_frame="keep"),
    "krea-realtime/prompt_lerp": dict(recompute_first_frame="keep"),  # blended over 4 chunks (the recipe's)
    "krea-realtime/reencode": {},  # the recipe's default: the first frame re-encoded from decoded pixels
}


@pytest.mark.parametrize("case", KREA_LIKE, ids=KREA_LIKE)
@torch.no_grad()
def test_krea_like_recipes_match_upstream(case, monkeypatch):
    recipe, scenario = case.split("/")
    golden = load_golden(recipe, scenario)
    pipe = krea_golden_pipeline(golden)
    steps = len(golden.settings["timesteps"])
    noise = InjectedNoise(golden, steps=steps)
    monkeypatch.setattr(stream_module, "randn_tensor", noise)
    monkeypatch.setattr(scheduler_module, "randn_tensor", noise)
    chunks = len(golden.clean)
    prompt = golden.settings.get("prompt") or golden.settings["prompts"][0]
    stream = pipe.stream(
        num_frames=pipe.latent_to_frames(3 * chunks), prompt_embeds=golden.text[prompt], output_type="latent",
        recipe=recipe, **KREA_LIKE[case],
    )  # fmt: skip
    switch = golden.settings.get("prompt_switch")
    switch_frames = dict(zip(golden.settings.get("switch_frames", []), golden.settings.get("prompts", [])[1:]))
    made = []
    for index in range(stream.num_chunks):
        if switch is not None and index == switch["before_block"]:
            stream.switch_prompt(prompt_embeds=golden.text[switch["to"]])
        if 3 * index in switch_frames:  # LongLive's switch frames are latent frames at chunk starts
            stream.switch_prompt(prompt_embeds=golden.text[switch_frames[3 * index]])
        made.append(next(stream))
    errors = chunk_errors(golden, made)
    print(f"\n{case} through the pipeline: {[f'{e:.1e}' for e in errors]}, floor {golden.floor:.1e}")
    assert noise.noise.exhausted
    assert max(errors) <= TOLERANCE, errors


# ----------------------------------------------------------------------------------------- Causal Forcing
CAUSAL_FORCING = (
    "chunkwise", "framewise", "framewise_2step", "framewise_1step",
    "switch_chunkwise", "switch_framewise", "switch_framewise_2step", "switch_framewise_1step",
)  # fmt: skip


@pytest.mark.parametrize("scenario", CAUSAL_FORCING)
@torch.no_grad()
def test_causal_forcing_recipes_match_upstream(scenario, monkeypatch):
    """Each Causal Forcing recipe (chunk-wise, frame-wise 4-, 2- and 1-step with the 4-step first frame) against
    the authors' `CausalInferencePipeline` (tools/record_causal_forcing_goldens.py)."""
    golden = load_golden("causal-forcing", scenario)
    recipe = golden.settings["recipe"]
    pipe = krea_golden_pipeline(golden)
    first = golden.settings.get("first_timesteps")
    noise = inject_noise(golden, monkeypatch)
    stream = pipe.stream(
        num_frames=pipe.latent_to_frames(golden.settings["latent_frames"]), prompt_embeds=golden.text["a"],
        output_type="latent", recipe=recipe,
    )  # fmt: skip
    request = stream.request
    assert request.geometry.chunk_frames == golden.settings["chunk_frames"]
    assert list(request.step_plan.timesteps) == pytest.approx(golden.settings["timesteps"], abs=1e-3)
    if first is not None:
        assert list(request.first_step_plan.timesteps) == pytest.approx(first, abs=1e-3)
    switch = golden.settings.get("switch")  # upstream has none: recorded as `switch_prompt` defines it
    made = []
    for index in range(stream.num_chunks):
        if switch is not None and index == switch["before_block"]:
            assert stream.switch_prompt(prompt_embeds=golden.text[switch["to"]]) == index
        made.append(next(stream))
    errors = chunk_errors(golden, made)
    print(f"\ncausal-forcing/{scenario} through the pipeline: max {max(errors):.1e}, floor {golden.floor:.1e}")
    assert noise.noise.exhausted
    assert max(errors) <= TOLERANCE, errors


@torch.no_grad()
def test_causal_forcing_switch_golden_sees_the_switch_and_the_recache(monkeypatch):
    """Controls for `switch_chunkwise`: after the switch upstream's chunks differ from the unswitched video's, and a
    stream that switched the text K/V without re-caching its context misses them (the re-cache is what matched)."""
    golden = load_golden("causal-forcing", "switch_chunkwise")
    switch = golden.settings["switch"]["before_block"]
    assert_switch_seen(golden, load_golden("causal-forcing", "chunkwise"), switch, TOLERANCE)
    pipe = krea_golden_pipeline(golden)
    inject_noise(golden, monkeypatch)
    monkeypatch.setattr(pipe, "recache", lambda *args, **kwargs: None)
    errors = chunk_errors(golden, switched_stream(pipe, golden, "causal-forcing", 21, switch))
    assert max(errors[:switch]) <= TOLERANCE and min(errors[switch:]) > 10 * TOLERANCE, errors

"""The call resolved in one place: one signature (`VideoCall`'s) on `stream` and `__call__`, one docstring,
`build_request` refusing what cannot work before any work, `num_frames_for`, and each stream's own interrupt."""

from __future__ import annotations

import dataclasses
import inspect
import threading

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from tiny_components import tiny_pipeline, tiny_text_encoder, tiny_transformer, word_tokenizer

from rolldiff import KreaRealtimeVideoPipeline
from rolldiff.cli import main
from rolldiff.pipelines.request import CALL_ARGUMENTS, VideoCall, build_request, resolve_call
from rolldiff.recipes import RECIPES

RED, BLUE = "a red circle moving left", "a blue square moving up"
SIZE = dict(height=16, width=16)


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def work_counter(pipe, monkeypatch):
    calls = {"transformer": 0, "text_encoder": 0}
    for name in calls:
        module = getattr(pipe, name)
        real = module.forward

        def counting(*args, _name=name, _real=real, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, "forward", counting)
    return calls


def _seed() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# ---------------------------------------------------------------------------------------- one signature
def test_stream_and_call_have_the_signature_of_video_call(pipe):
    names = list(VideoCall.names())
    assert list(inspect.signature(pipe.stream).parameters) == names
    assert list(inspect.signature(pipe.__call__).parameters) == [*names, "return_dict"]
    positional = [
        name
        for name, parameter in inspect.signature(pipe.stream).parameters.items()
        if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    assert positional == ["prompt", "num_frames", "height", "width"]
    assert inspect.signature(pipe.stream).parameters["num_frames"].default == 81


def test_the_one_docstring_documents_every_argument_in_diffusers_typed_style(pipe):
    for name in VideoCall.names():
        assert f"\n    {name} (`" in CALL_ARGUMENTS, name
    assert "prompt (`str` or `list[str]`, *optional*):" in pipe.__call__.__doc__
    assert "prompt (`str` or `list[str]`, *optional*):" in pipe.stream.__doc__


def test_every_recipe_setting_is_a_call_argument():
    for recipe in RECIPES.values():
        assert set(recipe.settings) <= set(VideoCall.names()), recipe.name


def test_a_misspelt_argument_is_named_as_the_methods(pipe):
    with pytest.raises(TypeError, match=r"stream\(\) got an unexpected keyword argument 'promt'"):
        pipe.stream(promt=RED)
    with pytest.raises(
        TypeError, match=r"__call__\(\) got an unexpected keyword argument 'num_frame'; did you mean 'num_frames'\?"
    ):
        pipe(RED, num_frame=4)
    with pytest.raises(TypeError, match=r"'xyz'$"):  # nothing near it: no guess
        pipe(RED, xyz=4)


@pytest.mark.parametrize(
    ("argument", "hint"),
    [
        ("num_inference_steps", "`denoising_steps` takes the step values"),
        ("timesteps", "`denoising_steps` takes the step values"),
        ("num_videos_per_prompt", "prompt=[text] * n"),
        ("seed", "generator=torch.Generator().manual_seed(seed)"),
        ("fps", "export_to_video(frames, path, fps=...)"),
    ],
)
def test_a_diffusers_argument_says_how_it_is_spelt_here_before_any_work(pipe, model_calls, argument, hint):
    with pytest.raises(TypeError) as caught:
        pipe(RED, num_frames=4, **{argument: 2})
    assert f"unexpected keyword argument '{argument}'; " in str(caught.value) and hint in str(caught.value)
    assert model_calls == []


def test_positional_arguments_bind_as_in_diffusers(pipe):
    request = pipe.stream(RED, 8, 16, 16).request
    assert (request.geometry.num_frames, request.geometry.height, request.geometry.width) == (8, 16, 16)


def test_explicit_arguments_win_over_the_recipe_and_the_recipe_over_the_loop_defaults(pipe):
    call = resolve_call(pipe, VideoCall(RED, recipe="krea-realtime", prompt_blend_chunks=2))
    assert call.prompt_blend_chunks == 2  # explicit
    assert call.context_policy == "recompute"  # the recipe's
    assert resolve_call(pipe, VideoCall(RED)).context_policy == "rolling"  # the loop default


def test_build_request_is_what_stream_uses(pipe):
    call = VideoCall(RED, 8, **SIZE, generator=_seed())
    direct = build_request(pipe, call)
    streamed = pipe.stream(RED, 8, **SIZE, generator=_seed()).request
    assert direct.geometry == streamed.geometry and direct.layout == streamed.layout
    assert direct.step_plan == streamed.step_plan and direct.options == streamed.options


# ---------------------------------------------------------------------------------------- bug: --steps 0
@pytest.mark.parametrize("steps", [[0], [0.0], [0, 0], (), [250, 500]])
def test_a_step_list_that_does_not_start_above_zero_is_refused_before_work(pipe, work_counter, steps):
    with pytest.raises(ValueError, match="denoising_steps"):
        pipe.stream(RED, 8, **SIZE, denoising_steps=steps)
    assert work_counter == {"transformer": 0, "text_encoder": 0}


def test_a_step_list_may_end_at_zero_as_krea_s(pipe):
    plan = pipe.stream(RED, 8, **SIZE, denoising_steps=[1000, 750, 500, 250, 0]).request.step_plan
    assert plan.steps[-1] == 0.0 and plan.timesteps[-1] == 0.0


def test_the_command_refuses_steps_zero_naming_the_flag(tmp_path, capsys):
    out = tmp_path / "video.mp4"
    assert main(["generate", "--prompt", RED, "--steps", "0", "--seconds", "1", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("rolldiff: error:") and "--steps" in error and "denoising_steps" in error
    assert not out.exists()


# ---------------------------------------------------------------------------------------- bug: no VAE
def _pipeline_without_vae() -> KreaRealtimeVideoPipeline:
    torch.manual_seed(0)
    return KreaRealtimeVideoPipeline(
        tokenizer=word_tokenizer(),
        text_encoder=tiny_text_encoder(),
        transformer=tiny_transformer(),
        vae=None,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        chunk_frames=2,
        sink_frames=2,
        window_frames=4,
        max_sequence_length=8,
    )


def test_krea_realtime_recipe_without_a_vae_is_refused_naming_the_way_out():
    pipe = _pipeline_without_vae()
    num_frames = pipe.num_frames_for(2, 8, recipe="krea-realtime")
    with pytest.raises(ValueError, match=r"recompute_first_frame='keep'") as error:
        pipe.stream(RED, num_frames, **SIZE, recipe="krea-realtime", output_type="latent")
    assert "krea-realtime" in str(error.value) and "VAE" in str(error.value)


def test_krea_realtime_recipe_without_a_vae_runs_with_the_first_frame_kept():
    pipe = _pipeline_without_vae()
    pipe.set_progress_bar_config(disable=True)
    num_frames = pipe.num_frames_for(2, 8, recipe="krea-realtime")
    latents = pipe(
        RED, num_frames, **SIZE, recipe="krea-realtime", recompute_first_frame="keep", output_type="latent"
    ).frames
    assert latents.shape[2] == pipe.frames_to_latent(num_frames) and torch.isfinite(latents).all()


def test_decoded_output_without_a_vae_is_refused_before_work():
    pipe = _pipeline_without_vae()
    with pytest.raises(ValueError, match="output_type='latent'"):
        pipe.stream(RED, pipe.num_frames_for(1, 8), **SIZE)


# ---------------------------------------------------------------------------------------- bug: interrupts
def test_a_stream_started_later_does_not_clear_another_streams_interrupt(pipe):
    first = pipe.stream(RED, 8, **SIZE, generator=_seed())
    next(first)
    pipe.interrupt = True  # diffusers' switch: reaches the streams running now
    second = pipe.stream(BLUE, 8, **SIZE, generator=_seed())
    assert len(list(second)) == second.num_chunks  # started after the switch: not stopped by it
    assert list(first) == []  # still stopped: the second stream's start did not clear it
    assert first.interrupted and not second.interrupted


def test_interrupt_stops_one_stream_only(pipe):
    first = pipe.stream(RED, 8, **SIZE, generator=_seed())
    second = pipe.stream(BLUE, 8, **SIZE, generator=_seed())
    next(first), next(second)
    first.interrupt()
    assert list(first) == []
    assert len(list(second)) == second.num_chunks - 1
    assert not pipe.interrupt  # no running stream is stopped


def test_interrupt_from_another_thread_stops_the_stream_before_its_next_step(pipe):
    steps = []

    def callback(pipeline, index, timestep, tensors):
        steps.append(index)
        if index == 1:
            worker = threading.Thread(target=stream.interrupt)
            worker.start()
            worker.join()
        return tensors

    stream = pipe.stream(RED, 8, **SIZE, generator=_seed(), callback_on_step_end=callback)
    assert list(stream) == []  # stopped inside the first chunk
    assert steps == [0, 1]


def test_pipe_interrupt_from_a_callback_still_stops_the_call(pipe):
    def callback(pipeline, index, timestep, tensors):
        if index == 4:  # the first step of the second chunk (4 steps a chunk)
            pipeline.interrupt = True
        return tensors

    frames = pipe(RED, 8, **SIZE, generator=_seed(), callback_on_step_end=callback).frames
    full = pipe(RED, 8, **SIZE, generator=_seed()).frames
    assert frames.shape[1] == full.shape[1] // pipe.stream(RED, 8, **SIZE).num_chunks
    assert (frames == full[:, : frames.shape[1]]).all()


# ---------------------------------------------------------------------------------------- num_frames_for
def test_num_frames_for_resolves_the_chunk_length_as_the_stream_does(pipe):
    chunk = pipe.config.chunk_frames
    assert pipe.num_frames_for(1, 8) == pipe.latent_to_frames(4 * chunk)  # 8 frames: whole chunks holding them
    assert pipe.num_frames_for(1, 8, chunk_frames=3) == pipe.latent_to_frames(9)
    assert pipe.num_frames_for(1, 8, recipe="self-forcing") == pipe.latent_to_frames(9)  # its chunk of 3
    image = torch.zeros(3, 16, 16)
    # self-forcing's image_mode "frame": one latent frame, then whole chunks
    assert pipe.num_frames_for(1, 8, recipe="self-forcing", image=image) == pipe.latent_to_frames(10)
    for call in (dict(), dict(chunk_frames=3), dict(recipe="self-forcing", image=image)):
        num_frames = pipe.num_frames_for(1, 8, **call)
        pipe.stream(RED, num_frames, **SIZE, **call)  # accepted as it is


@pytest.mark.parametrize(
    "seconds, fps, named",
    [(0, 8, "seconds"), (-1, 8, "seconds"), (float("inf"), 8, "seconds"), (1, 0, "fps"), ("1", 8, "seconds")],
)
def test_num_frames_for_refuses_bad_lengths_by_name(pipe, seconds, fps, named):
    with pytest.raises(ValueError, match=f"`{named}`"):
        pipe.num_frames_for(seconds, fps)


@pytest.mark.parametrize(
    "call, named",
    [(dict(chunk_frames=2.5), "chunk_frames"), (dict(window_frames="everything"), "window_frames"),
     (dict(window_frames=2), "window_frames"), (dict(recipe="longsana"), "recipe")],
)  # fmt: skip
def test_num_frames_for_refuses_a_chunk_or_window_the_stream_would_refuse(pipe, call, named):
    with pytest.raises(ValueError, match=f"`{named}`"):
        pipe.num_frames_for(1, 8, **call)


def test_the_request_is_frozen(pipe):
    request = pipe.stream(RED, 8, **SIZE).request
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.guidance_scale = 3.0


# ---------------------------------------------------------------------------------------- first_chunk_steps
def test_first_chunk_steps_alone_steps_the_first_chunk_only(pipe):
    steps_seen = []

    def count(pipeline, index, timestep, tensors):
        steps_seen.append(stream.next_chunk)
        return tensors

    stream = pipe.stream(RED, 8, **SIZE, denoising_steps=[1000], first_chunk_steps=[1000, 750, 500, 250],
                         callback_on_step_end=count, generator=_seed())  # fmt: skip
    list(stream)
    assert steps_seen == [0, 0, 0, 0, 1, 2, 3]  # 4 steps for chunk 0, then 1 a chunk


def test_first_chunk_steps_after_a_start_image_apply_to_the_first_denoised_chunk(pipe):
    request = pipe.stream(RED, 8, **SIZE, image=torch.zeros(3, 16, 16), first_chunk_steps=[1000, 500]).request
    assert request.step_plan_for(0) is request.step_plan  # the image's chunk is not denoised
    assert request.step_plan_for(1).steps == (1000.0, 500.0) and request.step_plan_for(2) is request.step_plan


@pytest.mark.parametrize("steps", [[0], [250, 500], "fast"])
def test_bad_first_chunk_steps_are_refused_before_work(pipe, work_counter, steps):
    with pytest.raises(ValueError, match="`first_chunk_steps`"):
        pipe.stream(RED, 8, **SIZE, first_chunk_steps=steps)
    assert work_counter == {"transformer": 0, "text_encoder": 0}


def test_next_chunk_frames_follows_the_vaes_causal_rule():
    pipe = tiny_pipeline(temporal_vae=True)  # chunks of 2 latent frames
    t = pipe.vae_scale_factor_temporal
    assert t > 1
    stream = pipe.stream(RED, pipe.latent_to_frames(6), **SIZE, generator=_seed())
    assert stream.next_chunk_frames == 1 + t * (2 - 1)  # the first chunk: 1 + t(c - 1)
    next(stream)
    assert stream.next_chunk_frames == t * 2  # then t c
    framewise = pipe.stream(RED, pipe.latent_to_frames(6), **SIZE, chunk_frames=1, window_frames=4)
    assert framewise.next_chunk_frames == 1

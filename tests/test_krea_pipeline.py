"""KreaRealtimeVideoPipeline on tiny random components: streaming, prompt switches, CFG, saving, errors."""

import numpy as np
import pytest
import torch
from tiny_components import tiny_pipeline

from rolldiff import KreaRealtimeVideoPipeline

PROMPT = "a red circle moving left"
SIZE = dict(height=16, width=16)


@pytest.fixture(scope="module")
def pipe() -> KreaRealtimeVideoPipeline:
    pipeline = tiny_pipeline()
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _seed(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_call_returns_frames_of_the_requested_size(pipe):
    frames = pipe(PROMPT, num_frames=8, generator=_seed(), **SIZE).frames
    assert frames.shape == (1, 8, 16, 16, 3)
    assert frames.min() >= 0 and frames.max() <= 1 and frames.std() > 0


def test_streamed_frames_equal_call_frames(pipe):
    whole = pipe(PROMPT, num_frames=10, generator=_seed(), **SIZE).frames
    chunks = list(pipe.stream(PROMPT, num_frames=10, generator=_seed(), **SIZE))
    assert [c.shape[1] for c in chunks] == [2] * 5
    np.testing.assert_allclose(np.concatenate(chunks, axis=1), whole, atol=1e-6)


def test_streamed_decode_equals_one_shot_with_a_temporal_vae():
    pipe = tiny_pipeline(temporal_vae=True)  # 4 latent frames -> 1 + 3 * 2 = 7 pixel frames
    pipe.set_progress_bar_config(disable=True)
    whole = pipe(PROMPT, num_frames=7, generator=_seed(), **SIZE).frames
    chunks = list(pipe.stream(PROMPT, num_frames=7, generator=_seed(), **SIZE))
    assert [c.shape[1] for c in chunks] == [3, 4]
    np.testing.assert_allclose(np.concatenate(chunks, axis=1), whole, atol=1e-5)


def test_same_seed_same_video_other_seed_other_video(pipe):
    first = pipe(PROMPT, num_frames=4, generator=_seed(1), **SIZE).frames
    again = pipe(PROMPT, num_frames=4, generator=_seed(1), **SIZE).frames
    other = pipe(PROMPT, num_frames=4, generator=_seed(2), **SIZE).frames
    np.testing.assert_array_equal(first, again)
    assert np.abs(first - other).max() > 1e-3


def test_prompt_switch_keeps_earlier_frames_and_changes_later_ones(pipe):
    base = pipe(PROMPT, num_frames=10, generator=_seed(), **SIZE).frames
    switched = pipe(
        prompt_schedule=[(0, PROMPT), (6, "a blue square moving up")], num_frames=10, generator=_seed(), **SIZE
    ).frames
    np.testing.assert_array_equal(switched[:, :6], base[:, :6])
    assert np.abs(switched[:, 6:] - base[:, 6:]).max() > 1e-4


def test_a_switch_inside_a_chunk_takes_effect_at_the_next_chunk(pipe):
    base = pipe(PROMPT, num_frames=8, generator=_seed(), **SIZE).frames
    switched = pipe(PROMPT, prompt_schedule=[(3, "a blue square moving up")], num_frames=8, generator=_seed(), **SIZE)
    np.testing.assert_array_equal(switched.frames[:, :4], base[:, :4])


def test_recache_rewrites_the_window_and_never_touches_the_sink(pipe, monkeypatch):
    """LongLive's bug zeroed the sink during re-cache; here the sink K/V must survive bit for bit."""
    seen = {}
    original = pipe.recache

    def spy(frames, embeds, cache, run):
        last = cache[len(cache) - 1]  # block 0's K/V precede any cross-attention; the last block's do not
        seen["sink_before"] = torch.stack([layer.keys[:, : layer.sink_tokens].clone() for layer in cache])
        seen["window_before"] = last.get()[0][:, last.sink_tokens :].clone()
        original(frames, embeds, cache, run)
        seen["sink_after"] = torch.stack([layer.keys[:, : layer.sink_tokens].clone() for layer in cache])
        seen["window_after"] = last.get()[0][:, last.sink_tokens :].clone()
        seen["cross"] = cache.cross[0].num_computations

    monkeypatch.setattr(pipe, "recache", spy)
    pipe(prompt_schedule=[(0, PROMPT), (6, "a blue square moving up")], num_frames=10, generator=_seed(), **SIZE)
    assert seen["sink_before"].abs().sum() > 0
    assert torch.equal(seen["sink_before"], seen["sink_after"])
    assert seen["window_before"].shape == seen["window_after"].shape
    assert not torch.allclose(seen["window_before"], seen["window_after"])
    assert seen["cross"] == 2  # one computation per prompt


def test_guidance_uses_a_separate_cache_and_changes_the_video(pipe):
    plain = pipe(PROMPT, num_frames=4, generator=_seed(), **SIZE).frames
    guided = pipe(PROMPT, num_frames=4, guidance_scale=4.0, negative_prompt="a cat", generator=_seed(), **SIZE).frames
    assert guided.shape == plain.shape and np.abs(guided - plain).max() > 1e-3


def test_output_types(pipe):
    latents = pipe(PROMPT, num_frames=4, output_type="latent", generator=_seed(), **SIZE).frames
    assert latents.shape == (1, 4, 4, 4, 4)
    tensor = pipe(PROMPT, num_frames=4, output_type="pt", generator=_seed(), **SIZE).frames
    assert tensor.shape == (1, 4, 3, 16, 16)
    images = pipe(PROMPT, num_frames=4, output_type="pil", generator=_seed(), **SIZE).frames
    assert len(images[0]) == 4 and images[0][0].size == (16, 16)
    (frames,) = pipe(PROMPT, num_frames=4, return_dict=False, generator=_seed(), **SIZE)
    assert frames.shape == (1, 4, 16, 16, 3)


def test_batch_of_prompts(pipe):
    frames = pipe([PROMPT, "a blue square moving up"], num_frames=4, generator=_seed(), **SIZE).frames
    assert frames.shape[0] == 2 and np.abs(frames[0] - frames[1]).max() > 1e-4


def test_callback_on_step_end_sees_every_step(pipe):
    calls = []

    def callback(pipeline, step, timestep, tensors):
        calls.append((step, round(float(timestep)), tuple(tensors["latents"].shape)))
        return {}

    pipe(PROMPT, num_frames=4, denoising_steps=[1000, 500], callback_on_step_end=callback, generator=_seed(), **SIZE)
    assert [c[0] for c in calls] == [0, 1, 2, 3]
    assert calls[0][1] == 1000 and calls[0][2] == (1, 4, 2, 4, 4)


def test_save_and_load_round_trip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    loaded = KreaRealtimeVideoPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.config.chunk_frames == 2 and list(loaded.config.denoising_steps) == [1000, 750, 500, 250]
    assert sorted(p.name for p in tmp_path.glob("*/*.safetensors"))  # weights saved as safetensors
    np.testing.assert_allclose(  # loading rebuilds the RoPE tables, which differ in the last bit
        loaded(PROMPT, num_frames=4, generator=_seed(), **SIZE).frames,
        pipe(PROMPT, num_frames=4, generator=_seed(), **SIZE).frames,
        atol=1e-5,
    )


def test_model_cpu_offload_gives_the_same_video(tmp_path):
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(PROMPT, num_frames=4, generator=_seed(), **SIZE).frames
    pipe.enable_model_cpu_offload(device="cpu")
    np.testing.assert_allclose(pipe(PROMPT, num_frames=4, generator=_seed(), **SIZE).frames, expected, atol=1e-6)


def test_generate_to_file_streams_an_mp4(pipe, tmp_path):
    import imageio.v3 as iio

    path = tmp_path / "video.mp4"
    written = pipe.generate_to_file(str(path), PROMPT, fps=8, num_frames=8, generator=_seed(), **SIZE)
    assert written == 8 and iio.imread(path).shape == (8, 16, 16, 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_frames=7), "num_frames.*nearest valid values: 6 or 8"),
        (dict(num_frames=0), "num_frames"),
        (dict(height=15), "height"),
        (dict(width=20), "width"),
        (dict(output_type="gif"), "output_type"),
        (dict(prompt_schedule=[]), "prompt_schedule"),
        (dict(prompt=None, prompt_schedule=[(0, "a"), (0, "b")]), "strictly increasing"),
        (dict(prompt=None, prompt_schedule=[(4, "a"), (2, "b")]), "must start at frame 0|strictly increasing"),
        (dict(prompt_schedule=[(99, "a blue square moving up")]), "out of range"),
        (dict(prompt=""), "prompt"),
        (dict(prompt=None), "prompt"),
        (dict(chunk_frames=2, window_frames=2), "window_frames"),
        (dict(denoising_steps=[250, 500]), "denoising_steps"),
        (dict(guidance_scale=0.5), "guidance_scale"),
        (dict(position_mode="rope"), "position_mode"),
        (dict(latents=torch.zeros(1, 4, 3, 4, 4)), "latents"),
    ],
)
def test_bad_input_is_refused_before_any_work(pipe, kwargs, message, monkeypatch):
    def no_work(*args, **kw):
        raise AssertionError("the model ran before the arguments were checked")

    monkeypatch.setattr(pipe.text_encoder, "forward", no_work)
    arguments = dict(prompt=PROMPT, num_frames=8, **SIZE)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        pipe(**arguments)
    with pytest.raises(ValueError, match=message):
        pipe.stream(**arguments)  # the streaming entry checks eagerly too, before the first chunk


def test_absolute_positions_past_the_rope_table_are_refused_up_front():
    pipe = tiny_pipeline()
    with pytest.raises(ValueError, match="RoPE table"):
        pipe.stream(PROMPT, num_frames=66, position_mode="absolute", **SIZE)  # 66 latent frames > 64
    assert pipe.stream(PROMPT, num_frames=66, position_mode="relative", **SIZE) is not None

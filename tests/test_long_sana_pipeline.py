"""LongSanaVideoPipeline on tiny random components: the shared chunk loop with LongSANA's cache and re-cache."""

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from test_long_sana_model import TINY_SANA, TOKENS_PER_FRAME
from tiny_components import tiny_vae

from rolldiff import LongSanaTransformer3DModel, LongSanaVideoPipeline
from rolldiff.defaults import load_pipeline, pipeline_class
from rolldiff.models.long_sana import sana_layout
from rolldiff.training.sana_components import SanaTinyConfig, build_gemma_text_encoder, build_gemma_tokenizer

PROMPT, OTHER = "a red circle moving left", "a blue square moving up"
SIZE = dict(height=16, width=16)  # 4x4 latents (VAE factor 4), 4 tokens per frame


def tiny_sana_pipeline(rope_max_seq_len: int = 64, num_layers: int | None = None, **config) -> LongSanaVideoPipeline:
    """Tiny random LongSANA pipeline: `TINY_SANA` (with `num_layers` blocks), 16x16 frames, chunks of 2, every
    earlier chunk in the state; `config` overrides the pipeline's settings."""
    torch.manual_seed(0)
    tokenizer = build_gemma_tokenizer()
    text_encoder = build_gemma_text_encoder(SanaTinyConfig(text_dim=16), len(tokenizer))
    torch.manual_seed(0)
    layers = {} if num_layers is None else {"num_layers": num_layers}
    transformer = LongSanaTransformer3DModel(**{**TINY_SANA, "rope_max_seq_len": rope_max_seq_len, **layers}).eval()
    defaults = dict(chunk_frames=2, window_frames=None, max_sequence_length=8, height=16, width=16)
    pipe = LongSanaVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer,
        vae=tiny_vae(temporal=False),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        **{**defaults, **config},
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe() -> LongSanaVideoPipeline:
    return tiny_sana_pipeline()


def _seed(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_call_returns_frames_of_the_requested_size(pipe):
    frames = pipe(PROMPT, num_frames=8, generator=_seed(), **SIZE).frames
    assert frames.shape == (1, 8, 16, 16, 3) and 0 <= frames.min() and frames.max() <= 1


def test_streamed_frames_equal_call_frames(pipe):
    whole = pipe(PROMPT, num_frames=8, generator=_seed()).frames
    streamed = np.concatenate(list(pipe.stream(PROMPT, num_frames=8, generator=_seed())), axis=1)
    np.testing.assert_allclose(streamed, whole, atol=1e-5)


def test_same_seed_same_video_other_seed_other_video(pipe):
    first = pipe(PROMPT, num_frames=6, generator=_seed(1), output_type="latent").frames
    again = pipe(PROMPT, num_frames=6, generator=_seed(1), output_type="latent").frames
    other = pipe(PROMPT, num_frames=6, generator=_seed(2), output_type="latent").frames
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    assert (other - first).abs().max() > 1e-3


def test_prompt_switch_keeps_earlier_frames_and_changes_later_ones(pipe):
    plain = pipe(PROMPT, num_frames=8, generator=_seed(), output_type="latent").frames
    switched = pipe(
        prompt_schedule=[(0, PROMPT), (4, OTHER)], num_frames=8, generator=_seed(), output_type="latent"
    ).frames
    torch.testing.assert_close(switched[:, :, :4], plain[:, :, :4], atol=0, rtol=0)
    assert (switched[:, :, 4:] - plain[:, :, 4:]).abs().max() > 1e-3


def test_a_switch_after_the_only_chunk_of_a_remainder_first_chunk_is_refused(pipe):
    """3 latent frames in chunks of 2 under `first_chunk="remainder"`: one chunk of 3 frames, starting at frame 0, so
    a switch at frame 1 would never apply (the schedule and the stream agree where the last chunk starts)."""
    stream = pipe.stream(PROMPT, num_frames=3, first_chunk="remainder", output_type="latent")
    assert stream.num_chunks == 1 and stream.last_chunk_start == 0
    with pytest.raises(ValueError, match="comes after the last chunk starts \\(frame 0\\)"):
        pipe.stream(prompt_schedule=[(0, PROMPT), (1, OTHER)], num_frames=3, first_chunk="remainder")


@pytest.mark.parametrize("window_frames", [None, 4])
def test_recache_replaces_the_last_chunks_contribution(window_frames, monkeypatch):
    """After a switch at chunk 2 the state is chunk 0 under the old prompt + chunk 1 under the new one, once."""
    pipe = tiny_sana_pipeline(window_frames=window_frames)
    seen = {}
    original = pipe.recache

    def spy(recent, embeds, cache, run):
        original(recent, embeds, cache, run)
        seen["vk"] = [layer.committed_vk.clone() for layer in cache]
        seen["conv"] = [layer.committed.clone() for layer in cache.slots["conv_state"]]
        seen["chunks"] = cache[0].committed_chunks
        seen["recent"] = recent.clone()

    monkeypatch.setattr(pipe, "recache", spy)
    clean = pipe(
        prompt_schedule=[(0, PROMPT), (4, OTHER)], num_frames=6, generator=_seed(), output_type="latent"
    ).frames
    torch.testing.assert_close(seen["recent"], clean[:, :, 2:4], atol=0, rtol=0)  # only the last chunk
    assert seen["chunks"] == 2  # re-written, not added: still two chunks
    # The same state built by hand: chunk 0 under PROMPT, chunk 1 under OTHER, each committed once.
    transformer = pipe.transformer
    context = None if window_frames is None else window_frames // 2 - 1
    layout = sana_layout(TOKENS_PER_FRAME, chunk_frames=2, context_chunks=context)
    cache = transformer.make_cache(layout, batch_size=1)
    with torch.no_grad():
        for start, prompt in ((0, PROMPT), (2, OTHER)):
            embeds = pipe.encode_prompt([prompt], 8)
            transformer.prepare_conditioning(cache, embeds)
            mask = embeds.abs().amax(-1) > 0
            zero = torch.zeros(1)
            transformer(
                clean[:, :, start : start + 2],
                embeds,
                zero,
                encoder_attention_mask=mask,
                kv_cache=cache,
                layout=layout,
            )
            cache.commit()
    for got, expected in zip(seen["vk"], (layer.committed_vk for layer in cache)):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    for got, expected in zip(seen["conv"], (layer.committed for layer in cache.slots["conv_state"])):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_relative_positions_run_past_the_rope_table_as_a_larger_table_would():
    """`relative` re-bases the state when the 64-frame table would run out; a 128-frame table never needs to."""
    short = tiny_sana_pipeline(rope_max_seq_len=64, position_mode="relative")
    long = tiny_sana_pipeline(rope_max_seq_len=128, position_mode="absolute")
    with pytest.raises(ValueError, match="RoPE table"):
        short.stream(PROMPT, num_frames=70, position_mode="absolute")
    arguments = dict(num_frames=70, denoising_steps=[1000, 500], output_type="latent")
    rebased = short(PROMPT, generator=_seed(), **arguments).frames
    expected = long(PROMPT, generator=_seed(), **arguments).frames
    torch.testing.assert_close(rebased, expected, atol=1e-4, rtol=0)


def test_guidance_uses_a_separate_cache_and_changes_the_video(pipe):
    plain = pipe(PROMPT, num_frames=4, generator=_seed(), output_type="latent").frames
    guided = pipe(PROMPT, num_frames=4, generator=_seed(), guidance_scale=3.0, output_type="latent").frames
    assert guided.shape == plain.shape and (guided - plain).abs().max() > 1e-3


def test_callback_and_batch_of_prompts(pipe):
    calls = []

    def callback(pipeline, step, timestep, tensors):
        calls.append((step, tuple(tensors["latents"].shape)))
        return {}

    frames = pipe([PROMPT, OTHER], num_frames=4, denoising_steps=[1000, 500], callback_on_step_end=callback).frames
    assert frames.shape[0] == 2 and [c[0] for c in calls] == [0, 1, 2, 3] and calls[0][1] == (2, 4, 2, 4, 4)


def test_save_and_load_round_trip_picks_the_class_from_model_index(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    assert pipeline_class(tmp_path) is LongSanaVideoPipeline
    loaded = load_pipeline(tmp_path, device="cpu", dtype="float32")
    loaded.set_progress_bar_config(disable=True)
    assert isinstance(loaded, LongSanaVideoPipeline) and loaded.config.window_frames == "all"
    assert sorted(p.name for p in tmp_path.glob("*/*.safetensors"))
    np.testing.assert_allclose(
        loaded(PROMPT, num_frames=4, generator=_seed()).frames,
        pipe(PROMPT, num_frames=4, generator=_seed()).frames,
        atol=1e-5,
    )


def test_model_cpu_offload_gives_the_same_video():
    pipe = tiny_sana_pipeline()
    expected = pipe(PROMPT, num_frames=4, generator=_seed(), output_type="latent").frames
    pipe.enable_model_cpu_offload(device="cpu")  # text K/V then filled by the first step, not ahead
    torch.testing.assert_close(pipe(PROMPT, num_frames=4, generator=_seed(), output_type="latent").frames, expected)


def test_generate_to_file_streams_an_mp4(pipe, tmp_path):
    import imageio.v3 as iio

    path = tmp_path / "video.mp4"
    assert pipe.generate_to_file(str(path), PROMPT, fps=8, num_frames=6, generator=_seed()) == 6
    assert iio.imread(path).shape == (6, 16, 16, 3)


def test_rolldiff_generate_runs_a_saved_sana_pipeline(pipe, tmp_path, capsys):
    import imageio.v3 as iio

    from rolldiff.cli import main

    pipe.save_pretrained(tmp_path / "sana")
    out = tmp_path / "video.mp4"
    argv = ["generate", "--model", str(tmp_path / "sana"), "--prompt", PROMPT, "--seconds", "0.5", "--fps", "8"]
    assert main([*argv, "--out", str(out)]) == 0
    assert iio.imread(out, plugin="FFMPEG", index=None).shape == (4, 16, 16, 3)
    assert main([*argv, "--out", str(tmp_path / "bad.mp4"), "--sink-frames", "2"]) == 2  # no sink in LongSANA
    assert "sink_frames" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_frames=7), "num_frames.*nearest valid values: 6 or 8"),
        (dict(sink_frames=2), "sink_frames"),
        (dict(window_frames=3), "window_frames"),
        (dict(window_frames=2), "window_frames"),
        (dict(chunk_frames=0), "chunk_frames"),
        (dict(position_mode="rope"), "position_mode"),
        (dict(height=15), "height"),
        (dict(denoising_steps=[250, 500]), "denoising_steps"),
        (dict(output_type="gif"), "output_type"),
        (dict(num_frames=66), "RoPE table"),
        (dict(width=1200), r"`width`=1200 is 150 patch positions, more than the RoPE table's 64"),
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
        pipe.stream(**arguments)


def test_window_all_is_every_earlier_chunk_and_a_long_window_is_cut_to_whole_chunks():
    pipe = tiny_sana_pipeline(window_frames=4)  # a config window of 2 chunks
    every = pipe.stream(PROMPT, num_frames=10, window_frames="all", generator=_seed()).request.layout
    assert every.unbounded and every.window_frames == "all"  # the running sum of every chunk, whatever the config says
    cut = pipe.stream(PROMPT, num_frames=10, window_frames=40, generator=_seed()).request.layout
    assert (
        cut.window_frames % cut.chunk_frames == 0 and cut.window_frames <= 10
    )  # whole chunks, no more than the video
    with pytest.raises(ValueError, match="'all'"):
        pipe.stream(PROMPT, num_frames=10, window_frames="every", generator=_seed())

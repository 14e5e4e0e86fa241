"""The image-to-video / video-to-video evaluation: exact on the renderer, held-out data, the pipeline adapters."""

import numpy as np
import pytest
import torch

from rolldiff.defaults import load_pipeline
from rolldiff.toyworld import all_prompts, parse_prompt, render_video
from rolldiff.toyworld.world import COLOURS, SHAPES, centre_trajectory, random_start
from rolldiff.training.conditioning_metrics import track_shape
from rolldiff.training.evaluate_conditioning import (
    SHIPPED_VIDEOS_PER_PROMPT,
    evaluate_image_to_video,
    evaluate_video_to_video,
    held_out_seeds,
    pipeline_image_to_video,
    pipeline_video_to_video,
    rendered_image_to_video,
    reprompts,
    video_to_video_table,
)
from rolldiff.training.evaluate_tiny import evaluation_prompts
from rolldiff.training.train_transformer import render_seed

PROMPTS = ["a red circle moving left", "a blue triangle moving down"]


def _true_centres(prompt: str, seed: int, num_frames: int) -> np.ndarray:
    direction = parse_prompt(prompt).direction
    return centre_trajectory(
        direction, random_start(direction, np.random.default_rng(seed), 32, 32), num_frames, 32, 32
    )


def test_the_track_is_exact_on_rendered_videos():
    for index, prompt in enumerate(all_prompts()):
        spec = parse_prompt(prompt)
        track = track_shape(render_video(prompt, 40, seed=index))
        assert track.found.all(), prompt
        assert (track.colours == list(COLOURS).index(spec.colour)).all(), prompt
        assert (track.shapes == SHAPES.index(spec.shape)).all(), prompt
        np.testing.assert_allclose(track.centres, _true_centres(prompt, index, 40), atol=1e-4, err_msg=prompt)


def test_held_out_videos_run_on_lines_no_training_video_of_their_prompt_used():
    for prompt in evaluation_prompts():
        index = all_prompts().index(prompt)
        axis = int(parse_prompt(prompt).direction in ("up", "down"))  # 0: moves along x, so y is its line
        training = {render_seed(index, video) for video in range(SHIPPED_VIDEOS_PER_PROMPT)}
        lines = {_true_centres(prompt, seed, 1)[0, 1 - axis] for seed in training}
        held_out = held_out_seeds(prompt, 4)
        held_lines = [_true_centres(prompt, seed, 1)[0, 1 - axis] for seed in held_out]
        assert not training & set(held_out)
        assert not lines & set(held_lines), prompt
        assert len(set(held_lines)) == 4  # and on lines of their own


def test_image_to_video_scores_the_true_continuation_as_perfect():
    table = evaluate_image_to_video(rendered_image_to_video(), PROMPTS, 2, windows=((1, 11), (40, 50)))
    perfect = {
        "colour_accuracy": 1.0,
        "keeps_colour": 1.0,
        "keeps_shape": 1.0,
        "found": 1.0,
        "distance_px": 0.0,
        "on_track": 1.0,
        "direction_accuracy": 1.0,
        "mean_speed": 1.0,
    }
    assert table["frames 40-49"] == perfect  # no frame 8 in it: no head start
    assert table["frames 1-10"] == {**perfect, "displacement_px_frame_8": 8.0, "prompted_way_by_frame_8": 1.0}


def test_a_held_first_chunk_lags_the_truth_by_its_length():
    held = 3
    table = evaluate_image_to_video(rendered_image_to_video(held_frames=held), PROMPTS, 1, windows=((1, 11),))
    expected = []
    for prompt in PROMPTS:
        centres = _true_centres(prompt, held_out_seeds(prompt, 1)[0], 11)
        lagged = centres[np.maximum(np.arange(11) - (held - 1), 0)]
        expected.append(np.linalg.norm(centres - lagged, axis=1)[1:].mean())
    assert table["frames 1-10"]["distance_px"] == pytest.approx(np.mean(expected), abs=1e-5)
    assert table["frames 1-10"]["direction_accuracy"] == pytest.approx(8 / 9)  # the held frames 1 -> 2 do not move
    assert table["frames 1-10"]["displacement_px_frame_8"] == 8.0 - (held - 1)


def _copy_input(prompts, video, strength, num_frames):
    return np.stack([video] * len(prompts))


def _ideal_edit(prompts, video, strength, num_frames):
    """Each prompt rendered on the input's path: the input's seed gives the same start for the same direction."""
    seed = held_out_seeds(PROMPTS[0], 1)[0]  # the input video of PROMPTS[0]
    assert np.array_equal(render_video(PROMPTS[0], num_frames, seed=seed), video)
    return np.stack([render_video(prompt, num_frames, seed=seed) for prompt in prompts])


def test_video_to_video_scores_a_copy_of_the_input_as_keeping_everything():
    table = evaluate_video_to_video(_copy_input, PROMPTS[:1], 12, strengths=(0.5,))
    assert table["0.5 colour"]["distance_px"] == 0.0 and table["0.5 shape"]["on_track"] == 1.0
    assert table["0.5 colour"]["keeps_colour"] == 1.0 and table["0.5 colour"]["takes_colour"] == 0.0
    assert table["0.5 shape"]["keeps_shape"] == 1.0 and table["0.5 shape"]["takes_shape"] == 0.0


def test_video_to_video_scores_the_prompt_on_the_input_path_as_a_perfect_edit():
    table = evaluate_video_to_video(_ideal_edit, PROMPTS[:1], 12, strengths=(0.5,))
    for kind, kept in (("colour", "keeps_shape"), ("shape", "keeps_colour")):
        scores = table[f"0.5 {kind}"]
        assert scores["distance_px"] == pytest.approx(0.0, abs=1e-4) and scores["on_track"] == 1.0
        assert scores["takes_colour"] == scores["takes_shape"] == scores[kept] == 1.0
        assert scores[f"keeps_{kind}"] == 0.0


def test_reprompts_change_one_attribute_and_keep_the_direction():
    assert reprompts("a red circle moving left") == [
        ("colour", "a green circle moving left"),
        ("colour", "a blue circle moving left"),
        ("colour", "a yellow circle moving left"),
        ("shape", "a red square moving left"),
        ("shape", "a red triangle moving left"),
    ]


@pytest.fixture(scope="module")
def pipe():
    pipeline = load_pipeline("tiny-bouncing-shapes", device="cpu", dtype="float32")
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@torch.no_grad()
def test_the_embedded_model_starts_each_video_on_its_own_image(pipe):
    """Images reach their own prompts: the first chunk scores as the image held 3 frames through the VAE does."""
    windows = ((0, 3),)
    model = evaluate_image_to_video(pipeline_image_to_video(pipe), PROMPTS, 2, windows)["frames 0-2"]
    held = evaluate_image_to_video(rendered_image_to_video(3, vae=pipe.vae), PROMPTS, 2, windows)["frames 0-2"]
    assert model["found"] == model["keeps_colour"] == 1.0
    assert model == pytest.approx(held, abs=0.02)
    other = evaluate_image_to_video(rendered_image_to_video(3, other_start=True), PROMPTS, 2, windows)["frames 0-2"]
    assert other["distance_px"] > model["distance_px"] + 3


@torch.no_grad()
def test_image_mode_frame_starts_on_the_image_alone_and_scores_against_the_unheld_truth(pipe):
    """In the "frame" convention frame 0 is the image and frame 1 is generated; the best reference holds nothing."""
    windows = ((0, 1), (1, 4))
    model = evaluate_image_to_video(pipeline_image_to_video(pipe, image_mode="frame"), PROMPTS, 1, windows)
    truth = evaluate_image_to_video(rendered_image_to_video(1, vae=pipe.vae), PROMPTS, 1, windows)
    assert model["frames 0-0"]["keeps_colour"] == 1.0
    assert model["frames 0-0"]["distance_px"] == pytest.approx(truth["frames 0-0"]["distance_px"], abs=0.3)
    assert truth["frames 1-3"]["mean_speed"] == pytest.approx(1.0, abs=0.1)  # nothing held: it moves at once


@torch.no_grad()
def test_the_embedded_model_follows_the_input_at_low_strength(pipe):
    table = video_to_video_table(pipe, PROMPTS[:1], 6, strengths=(0.3,))
    assert table["0.3 colour"]["on_track"] == table["0.3 shape"]["on_track"] == 1.0
    unchanged = table["input through the VAE, colour"]
    assert unchanged["keeps_colour"] == unchanged["on_track"] == 1.0 and unchanged["takes_colour"] == 0.0


def test_video_to_video_needs_whole_chunks(pipe):
    generate = pipeline_video_to_video(pipe)
    with pytest.raises(ValueError, match="num_frames must be whole chunks.*got 7"):
        generate(PROMPTS, np.zeros((7, 32, 32, 3), np.uint8), 0.5, 7)


def test_evaluate_tiny_conditioning_scores_the_same_pipeline_and_prompts(monkeypatch, capsys):
    from rolldiff.defaults import default_model_path
    from rolldiff.training import evaluate_conditioning, evaluate_tiny

    model, forwarded = str(default_model_path()), []
    monkeypatch.setattr(evaluate_conditioning, "main", forwarded.append)
    argv = ["--num-frames", "6", "--windows", "0:6", "--prompts", "1", "--conditioning"]
    evaluate_tiny.main([*argv, "--pipeline", model])
    assert "1 prompts x 1 seeds x 6 frames" in capsys.readouterr().out
    assert forwarded == [["--models", model, "--prompts", "1", "--threads", "1"]]

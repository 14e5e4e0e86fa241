"""Specification of the toy world (renderer) and of the metrics that judge videos against it."""

import json
import time

import numpy as np
import pytest

from rolldiff.toyworld.evaluate import evaluate_generator, ground_truth_fn, main
from rolldiff.toyworld.metrics import evaluate_video
from rolldiff.toyworld.world import (
    BACKGROUND_RGB,
    COLOURS,
    SceneSpec,
    all_prompts,
    parse_prompt,
    render_video,
    sample_batch,
    shape_area,
)


def foreground_centroids(video: np.ndarray) -> np.ndarray:
    """(x, y) centroid per frame of every non-background pixel."""
    mask = (video != np.array(BACKGROUND_RGB, dtype=np.uint8)).any(-1)  # (F, H, W)
    area = mask.sum((1, 2))
    assert (area > 0).all()
    x = (mask.sum(1) * np.arange(video.shape[2])).sum(1) / area
    y = (mask.sum(2) * np.arange(video.shape[1])).sum(1) / area
    return np.stack([x, y], axis=1)  # (F, 2)


# World


def test_parse_prompt_round_trips_every_prompt():
    prompts = all_prompts()
    assert len(prompts) == 48
    assert [parse_prompt(p).prompt for p in prompts] == prompts
    assert parse_prompt("a red circle moving left") == SceneSpec("red", "circle", "left")


@pytest.mark.parametrize(
    "prompt", ["a purple circle moving left", "a red star moving left", "a red circle moving diagonally", "red circle"]
)
def test_parse_prompt_error_names_prompt_and_allowed_words(prompt):
    with pytest.raises(ValueError, match="prompt must be") as error:
        parse_prompt(prompt)
    assert "yellow" in str(error.value) and "triangle" in str(error.value) and repr(prompt) in str(error.value)


def test_render_is_deterministic_for_a_seed_and_varies_across_seeds():
    first = render_video("a green square moving down", 20, seed=3)
    assert first.shape == (20, 32, 32, 3) and first.dtype == np.uint8
    assert np.array_equal(first, render_video("a green square moving down", 20, seed=3))
    assert not np.array_equal(first, render_video("a green square moving down", 20, seed=4))


@pytest.mark.parametrize(
    "direction,velocity", [("left", (-1, 0)), ("right", (1, 0)), ("up", (0, -1)), ("down", (0, 1))]
)
def test_first_frames_move_one_pixel_per_frame_in_the_prompted_direction(direction, velocity):
    for seed in range(5):
        video = render_video(f"a blue triangle moving {direction}", 9, seed=seed)
        steps = np.diff(foreground_centroids(video), axis=0)
        np.testing.assert_allclose(steps, np.tile(velocity, (8, 1)), atol=1e-6)


@pytest.mark.parametrize("shape", ["circle", "square", "triangle"])
def test_bounces_keep_the_whole_shape_inside_the_frame(shape):
    video = render_video(f"a red {shape} moving right", 100, height=32, width=40, seed=1)
    areas = (video != np.array(BACKGROUND_RGB, dtype=np.uint8)).any(-1).sum((1, 2))
    assert (areas == shape_area(shape, 32, 40)).all()  # never clipped by a wall
    x_steps = np.diff(foreground_centroids(video)[:, 0])
    assert (x_steps > 0).any() and (x_steps < 0).any()  # it did bounce


def test_shape_has_exactly_the_prompted_colour_and_about_10_px_diameter():
    video = render_video("a yellow square moving up", 1, seed=0)
    colours = {tuple(c) for c in video.reshape(-1, 3)}
    assert colours == {BACKGROUND_RGB, COLOURS["yellow"]}
    assert shape_area("square", 32, 32) == 100


def test_render_rejects_bad_sizes_and_starts():
    with pytest.raises(ValueError, match="height"):
        render_video("a red circle moving up", 4, height=8)
    with pytest.raises(ValueError, match="start"):
        render_video("a red circle moving up", 4, start=(1.0, 16.0))


def test_render_1000_frames_is_fast():
    began = time.perf_counter()
    render_video("a red circle moving right", 1000)
    assert time.perf_counter() - began < 1.0


def test_sample_batch_shapes_and_determinism():
    videos, prompts = sample_batch(3, 5, rng=7, height=32, width=48)
    assert videos.shape == (3, 5, 32, 48, 3) and len(prompts) == 3
    again, prompts_again = sample_batch(3, 5, rng=np.random.default_rng(7), height=32, width=48)
    assert np.array_equal(videos, again) and prompts == prompts_again


# Metrics


@pytest.mark.parametrize("prompt", all_prompts()[::7])
def test_ground_truth_scores_near_perfect_in_early_and_late_windows(prompt):
    video = render_video(prompt, 300, seed=2)
    early = evaluate_video(video, prompt, window=(0, 100))
    late = evaluate_video(video, prompt, window=(200, 300))
    for metrics in (early, late):
        assert metrics["presence"] == 1.0
        assert metrics["colour_accuracy"] > 0.95
        assert metrics["direction_accuracy"] > 0.95
        assert metrics["stray_pixels"] < 0.01
        assert metrics["mean_speed"] == pytest.approx(1.0, abs=0.01)
    assert early["initial_direction_correct"] == 1.0
    assert "initial_direction_correct" not in late  # bounces make the sign unknowable late


def test_odd_diameter_bounces_without_pausing():
    video = render_video("a red circle moving right", 200, height=48, width=48, seed=0)  # diameter 15 px
    metrics = evaluate_video(video, "a red circle moving right")
    assert metrics["direction_accuracy"] == 1.0 and metrics["mean_speed"] == pytest.approx(1.0)


def test_blurred_edges_still_count_as_the_prompted_colour():
    video = render_video("a yellow triangle moving left", 30).astype(np.float32)
    padded = np.pad(video, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge")
    blurred = sum(padded[:, i : i + 32, j : j + 32] for i in range(3) for j in range(3)) / 9  # 3x3 box blur
    metrics = evaluate_video(blurred.astype(np.uint8), "a yellow triangle moving left")
    assert metrics["presence"] == 1.0 and metrics["colour_accuracy"] > 0.95 and metrics["stray_pixels"] < 0.01


def test_noise_video_has_low_presence():
    noise = np.random.default_rng(0).integers(0, 256, (30, 32, 32, 3), dtype=np.uint8)
    assert evaluate_video(noise, "a red circle moving left")["presence"] < 0.1


def test_wrong_colour_has_low_colour_accuracy_and_no_presence():
    video = render_video("a blue circle moving left", 30)
    metrics = evaluate_video(video, "a red circle moving left")
    assert metrics["colour_accuracy"] < 0.05 and metrics["presence"] == 0.0


def test_static_shape_has_zero_speed_and_no_direction():
    video = np.repeat(render_video("a green circle moving right", 1), 30, axis=0)
    metrics = evaluate_video(video, "a green circle moving right")
    assert metrics["mean_speed"] == pytest.approx(0.0)
    assert metrics["direction_accuracy"] == 0.0 and metrics["initial_direction_correct"] == 0.0


def test_motion_along_the_wrong_axis_has_low_direction_accuracy():
    video = render_video("a red square moving up", 60)
    assert evaluate_video(video, "a red square moving right")["direction_accuracy"] < 0.05


def test_motion_with_the_wrong_sign_fails_only_the_initial_direction():
    video = render_video("a red square moving left", 60)
    metrics = evaluate_video(video, "a red square moving right")
    assert metrics["direction_accuracy"] == 1.0 and metrics["initial_direction_correct"] == 0.0


def test_scattered_salt_pixels_raise_the_stray_fraction():
    video = render_video("a red circle moving down", 30)
    salt = np.random.default_rng(0).random(video.shape[:3]) < 0.05
    video[salt] = COLOURS["yellow"]
    assert evaluate_video(video, "a red circle moving down")["stray_pixels"] > 0.03


def test_evaluate_video_rejects_a_window_past_the_end():
    with pytest.raises(ValueError, match="window"):
        evaluate_video(render_video("a red circle moving down", 10), "a red circle moving down", window=(5, 20))


# Evaluation driver


def test_evaluate_generator_reports_each_window():
    table = evaluate_generator(ground_truth_fn(), all_prompts()[:2], 40, windows=[(0, 20), (20, 40)])
    assert list(table) == ["frames 0-20", "frames 20-40"]
    assert table["frames 0-20"]["presence"] == 1.0 and "initial_direction_correct" not in table["frames 20-40"]


def test_main_ground_truth_writes_json(tmp_path, capsys):
    path = tmp_path / "gt.json"
    main(["--ground-truth", "--num-frames", "30", "--windows", "0:10,20:30", "--json", str(path)])
    assert "| presence | fraction | 1.000 | 1.000 |" in capsys.readouterr().out
    saved = json.loads(path.read_text())
    assert saved["table"]["frames 20-30"]["presence"] == 1.0

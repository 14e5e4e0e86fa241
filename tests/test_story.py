"""Stories (Infinity-RoPE's prompt syntax, `rolldiff.story`): parsing, the schedule and cuts they give a call (the
chunks upstream's code switches at, read from the infinity-rope goldens' own prompts), and their subtitles."""

from __future__ import annotations

import numpy as np
import pytest
from recipe_goldens import load_golden
from test_recipes_pipeline import krea_golden_pipeline
from tiny_components import tiny_pipeline

from rolldiff.pipelines.io.subtitles import draw_subtitle, subtitle_overlay
from rolldiff.pipelines.request.prompt_schedule import PromptSchedule, ScheduleFrameError
from rolldiff.pipelines.request.text_encoding import PromptWarning
from rolldiff.story import DEFAULT_SCENE_CHUNKS, Scene, Story, parse_story

RED, BLUE, GREEN = "a red circle moving left", "a blue square moving up", "a green square moving left"


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline()  # chunks of 2 latent frames, no time compression: 2 pixel frames a chunk


# ---------------------------------------------------------------------------------------- parsing
def test_a_story_is_scenes_with_lengths_and_marks_then_subtitles():
    story = parse_story(f" {RED}[2s] |{BLUE} [ 1.5 s# ]| {GREEN} ; Red | Blue ")
    assert story.scenes == (Scene(RED, 2.0), Scene(BLUE, 1.5, cut=True), Scene(GREEN, None))
    assert story.subtitles == ("Red", "Blue", "")  # one per scene, the missing ones empty
    assert story.seconds is None  # a scene without a length: no total in seconds
    assert parse_story(f"{RED}[2s] | {BLUE}[3s]").seconds == 5.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "`story` must be scenes as text"),
        (3, "`story` must be scenes as text"),
        (f"{RED}[2s] | | {BLUE}", "`story` scene 2 has no prompt"),
        (f"{RED}[2 sec]", "`story` scene 1: '[2 sec]' is not its length (a scene has one, written '[10s]'"),
        (f"{RED}[2s][3s]", "`story` scene 1: '[3s]' is not its length"),
        (f"{RED}[2s", "`story` scene 1: '[2s' is not its length"),  # never closed
        (f"{RED}[0s]", "`story` scene 1 lasts [0s]; a scene lasts more than 0 seconds"),
        (f"{RED}[1s] ; one | two", "`story` has 2 subtitles (after ';') for 1 scenes"),
    ],
)
def test_a_story_that_cannot_be_read_is_refused_naming_what_to_write(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        parse_story(text)


# ---------------------------------------------------------------------------------------- the call
def test_scenes_last_whole_chunks_as_upstream_counts_them_and_a_mark_cuts_after_its_scene(pipe):
    """At 8 fps and 2 pixel frames a chunk: 1 s is int(8 / 2) = 4 chunks, 1.5 s 6, no length 14; the `#` of scene 2
    makes the switch to scene 3 a cut; the video covers every scene's chunks."""
    story = parse_story(f"{RED}[1s] | {BLUE}[1.5s#] | {GREEN}")
    assert story.scene_chunks(8, 2) == [4, 6, DEFAULT_SCENE_CHUNKS]
    call = story.arguments(pipe, 8, height=16, width=16)
    assert call["prompt_schedule"] == [(0, RED), (8, BLUE), (20, GREEN)] and call["scene_cuts"] == [20]
    assert call["prompt"] is None and call["num_frames"] == 2 * (4 + 6 + DEFAULT_SCENE_CHUNKS)
    assert (call["height"], call["width"]) == (16, 16)  # the call's own arguments pass through


def test_the_length_is_the_storys_seconds_rounded_up_to_whole_chunks_and_num_frames_wins(pipe):
    story = parse_story(f"{RED}[1s] | {BLUE}[1.3s]")  # 2.3 s at 8 fps: 18.4 frames -> 20 (whole chunks of 2)
    assert story.arguments(pipe, 8)["num_frames"] == 20
    assert story.arguments(pipe, 8, num_frames=12)["num_frames"] == 12
    assert story.arguments(pipe, 8)["scene_cuts"] is None  # no mark, no cut


def test_the_chunks_follow_the_recipe_of_the_call(pipe):
    """Under `recipe="infinity-rope"` a chunk is 3 latent frames: 1 s at 12 fps is 4 chunks, the switch at 12."""
    call = parse_story(f"{RED}[1s#] | {BLUE}[1s]").arguments(pipe, 12, recipe="infinity-rope")
    assert call["prompt_schedule"] == [(0, RED), (12, BLUE)] and call["scene_cuts"] == [12]
    assert call["recipe"] == "infinity-rope"


@pytest.mark.parametrize("scenario", ["switch", "scene_cut", "wide_scene_cut"])
def test_upstreams_own_prompts_switch_and_cut_where_its_code_did(scenario):
    """The infinity-rope goldens were made from upstream's prompt syntax (`a[2.25s] | b`, `a[2.25s#] | b`,
    `a[3s#] | b`) at 16 fps on Wan's VAE (4 frames a latent frame): the story switches (and cuts) at the first frame
    of the block upstream's code switched before, and the golden tests prove that switch equal to upstream's."""
    golden = load_golden("infinity-rope", scenario)
    settings = golden.settings
    pipe = krea_golden_pipeline(golden)
    call = parse_story(settings["prompt"]).arguments(pipe, 16, recipe="infinity-rope")
    switch = pipe.latent_to_pixel_start(3 * settings["switch_before_block"])
    assert call["prompt_schedule"] == [(0, "a"), (switch, "b")]
    assert call["scene_cuts"] == ([switch] if settings["scene_cut"] else None)


def test_with_a_start_image_as_its_own_frame_the_scenes_count_from_the_chunk_after_it(pipe):
    """`image_mode="frame"`: the image is one latent frame before the chunks (upstream's `initial_latent`); the first
    scene still starts at frame 0, the next one a frame later than without the image, and the call runs."""
    image = np.full((16, 16, 3), 128, dtype=np.uint8)
    story = parse_story(f"{RED}[1s#] | {BLUE}[1s]")
    call = story.arguments(pipe, 8, height=16, width=16, position_mode="relative", image=image, image_mode="frame")
    assert call["prompt_schedule"] == [(0, RED), (9, BLUE)] and call["scene_cuts"] == [9]
    assert call["num_frames"] == 17 and pipe(**call).frames.shape[1] == 17


def test_a_mark_on_the_last_scene_cuts_nothing_and_says_so(pipe):
    """Infinity-RoPE's README words `#` as "this scene starts with a cut", its code as "cut after this scene": the
    README's `a[1s] | b[1s#]` makes no cut there, and the story says so instead of quietly making none."""
    with pytest.warns(PromptWarning, match=r"the last scene \(scene 2\) is marked '#'.*mark the scene before it"):
        call = parse_story(f"{RED}[1s] | {BLUE}[1s#]").arguments(pipe, 8)
    assert call["scene_cuts"] is None


def test_a_call_with_its_own_prompt_schedule_or_cuts_is_refused_naming_them(pipe):
    with pytest.raises(ValueError, match=r"`story` holds the prompts, their switches and cuts; drop `prompt` and "
                       r"`scene_cuts`\.$"):  # fmt: skip
        parse_story(f"{RED}[1s]").arguments(pipe, 8, prompt=BLUE, scene_cuts=[4])


@pytest.mark.parametrize(
    ("schedule", "frame"),
    [([(0, RED), (400, BLUE)], 400), ([(0, RED), (4, BLUE), (4, GREEN)], 4), ([(0, RED), (15, BLUE)], 15)],
    ids=["out-of-range", "not-increasing", "after-the-last-chunk"],
)
def test_a_refused_schedule_frame_says_which_frame(schedule, frame):
    """A front end that builds one schedule from several inputs (`--prompt-at`, `--cut-at`, a story) names the input
    by `ScheduleFrameError.frame`, not by reading the message."""
    with pytest.raises(ScheduleFrameError) as refused:
        PromptSchedule.build(None, schedule, num_frames=16, last_chunk_start=14)
    assert refused.value.frame == frame and isinstance(refused.value, ValueError)


def test_a_bad_fps_is_named(pipe):
    with pytest.raises(ValueError, match="`fps`"):
        parse_story(f"{RED}[1s]").arguments(pipe, 0)


# ---------------------------------------------------------------------------------------- subtitles
def test_subtitles_last_their_scenes_seconds_and_a_scene_without_a_length_ends_them():
    story = Story((Scene(RED, 1.0), Scene(BLUE, 0.5), Scene(GREEN, None), Scene(RED, 1.0)), ("A", "", "C", "D"))
    assert story.subtitle_spans(8) == [(0, 8, "A")]  # "" draws nothing; no length: no timing after it
    assert parse_story(f"{RED}[1s] | {BLUE}[2s] ; A | B").subtitle_spans(16) == [(0, 16, "A"), (16, 48, "B")]


def test_a_subtitle_is_drawn_at_the_bottom_and_only_on_its_frames():
    frames = np.full((6, 96, 128, 3), 90, dtype=np.uint8)
    drawn = subtitle_overlay([(2, 4, "Hi")])(frames, first_frame=1)  # video frames 1..6: frames[1:3] are 2, 3
    changed = [index for index in range(6) if not np.array_equal(drawn[index], frames[index])]
    assert changed == [1, 2]
    rows = np.flatnonzero((drawn[1] != 90).any(axis=(1, 2)))
    assert rows.min() > 96 // 2 and rows.max() < 96 - 5  # in the lower half, above the margin
    assert (drawn[1] == 255).all(axis=-1).any() and (drawn[1] == 0).all(axis=-1).any()  # white text, black outline
    assert np.array_equal(frames[0], np.full((96, 128, 3), 90))  # the input is not drawn on
    assert subtitle_overlay([]) is None


def test_a_subtitle_fits_a_tiny_frame():
    frame = np.zeros((32, 32, 3), dtype=np.uint8)
    rows = np.flatnonzero(draw_subtitle(frame, "Red").any(axis=(1, 2)))
    assert rows.size and rows.min() >= 0 and rows.max() < 32 - 2

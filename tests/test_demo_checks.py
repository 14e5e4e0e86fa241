"""The demo's checks, without a server: the Generate form's fields (`rolldiff.demo.fields`), the pipeline's rules
as a Generate press shows them (relabelled with the fields' labels), and the one address check that the demo's
`launch`, its example script and `rolldiff demo` share (`rolldiff.demo.serving`).

Every refusal names the field (or argument), says what is allowed and repeats the value received.
"""

import math
import socket
import subprocess
import sys
import threading
import warnings

import numpy as np
import PIL.Image
import pytest
from tiny_components import tiny_pipeline

from rolldiff.cli import main
from rolldiff.demo import (
    FIELD_LABELS,
    MAX_SEED,
    ChunkSettings,
    DemoInputError,
    DemoSession,
    DemoSettings,
    GenerateConfig,
    GenerateFields,
    Generation,
    InputConfig,
    ModelShelf,
    check_address,
    parse_image,
    parse_length,
    parse_position_mode,
    parse_prompt,
    parse_recipe,
    parse_seconds,
    parse_steps,
    parse_strength,
    parse_video,
    parse_whole_number,
    prompt_warnings,
    relabel,
    stop_generation,
)
from rolldiff.pipelines.request.call import VideoCall
from rolldiff.pipelines.request.text_encoding import PromptWarning

RED = "a red circle moving left"
ZIGZAG = "a red circle moving zigzag"  # "zigzag" is not a word of the tiny tokenizer
STEPS_RULE = (
    "Denoising steps: must be strictly decreasing numbers in [0, 1000], the first above 0 (a chunk starts from "
    "noise; only the last may be 0), e.g. [1000, 750, 500, 250]; got "
)
STRENGTH_RULE = "Strength: must be a number in (0, 1] (1: ignore the input's content), got "


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generation(pipe, **fields) -> Generation:
    """One Generate press on the tiny pipeline: the form's checks, then the stream made (every pipeline check),
    and no chunk yet."""
    config = GenerateFields(**{"prompt": RED, "seconds": 1, **fields}).check(60)
    return Generation(ModelShelf({"tiny": pipe}), config, DemoSettings(height=16, width=16, fps=4))


# ---------------------------------------------------------------------------------------- one field
@pytest.mark.parametrize(("raw", "number"), [(3, 3), (3.0, 3), ("3", 3), (" 12 ", 12), ("4.0", 4), (0, 0)])
def test_a_whole_number_is_read_from_a_number_or_its_text(raw, number):
    assert parse_whole_number("Seed", raw, 0, 100) == number
    assert type(parse_whole_number("Seed", raw, 0, 100)) is int


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (2.5, "Seed: type a whole number from 0 to 100, got 2.5."),
        (101, "Seed: type a whole number from 0 to 100, got 101."),
        (-1, "Seed: type a whole number from 0 to 100, got -1."),
        ("two", "Seed: type a number, got 'two'."),
        (True, "Seed: type a number, got True."),  # a bool is not a number a person typed
        ([3], "Seed: type a number, got [3]."),
        (math.inf, "Seed: type a finite number, got inf."),
        ("nan", "Seed: type a finite number, got 'nan'."),
    ],
)
def test_a_bad_whole_number_names_the_field_the_range_and_the_value(raw, message):
    with pytest.raises(DemoInputError) as refused:
        parse_whole_number("Seed", raw, 0, 100)
    assert str(refused.value) == message


def test_a_whole_number_without_an_upper_bound_says_from_lowest_up():
    assert parse_whole_number("Chunk frames", "1000000", 1) == 1_000_000
    with pytest.raises(DemoInputError, match=r"^Chunk frames: type a whole number from 1 up, got 0\.$"):
        parse_whole_number("Chunk frames", 0, 1)


def test_seconds_are_above_zero_and_at_most_the_demos_limit():
    assert parse_seconds("2.5", 60) == 2.5 and parse_seconds(60, 60) == 60.0
    for raw in (0, -1, 60.5):
        with pytest.raises(
            DemoInputError, match=rf"^Length \(seconds\): type a number above 0 and at most 60, got {raw!r}"
        ):
            parse_seconds(raw, 60)


@pytest.mark.parametrize(("raw", "typed"), [(100000, "100000"), ("1e9", "1e9"), (1e9, "1000000000.0")])
def test_a_length_above_the_longest_is_clamped_and_said(raw, typed):
    assert parse_length(raw, 60) == (
        60.0,
        f"Length (seconds): {typed} is more than this demo makes; making the longest, 60 s.",
    )
    assert parse_length("2.5", 60) == (2.5, None)
    config = GenerateFields(prompt=RED, seconds=raw).check(60)
    assert config.seconds == 60.0 and config.notes == (parse_length(raw, 60)[1],)


@pytest.mark.parametrize("raw", [0, -5, "0", "-5"])
def test_a_length_of_zero_or_less_is_refused_not_made_one_second(raw):
    with pytest.raises(DemoInputError, match=r"^Length \(seconds\): type a number above 0 and at most 60"):
        parse_length(raw, 60)


def test_the_run_says_what_it_makes_in_whole_chunks(pipe):
    generation = _generation(pipe, seconds=1.1)  # 5 frames at 4 fps: 3 whole chunks of 2
    assert generation.plan_note() == (
        "1.1 s -> 6 frames, whole chunks of 2 latent frames (3 chunks) at 4 fps. Text-to-video: no start image "
        "or input video (a file the uploader refused is not used)."
    )
    assert generation.num_frames == pipe.num_frames_for(1.1, 4)
    clamped = Generation(
        ModelShelf({"tiny": pipe}), GenerateFields(prompt=RED, seconds=9).check(2),
        DemoSettings(height=16, width=16, fps=4),
    )  # fmt: skip
    assert clamped.plan_note().endswith("Length (seconds): 9 is more than this demo makes; making the longest, 2 s.")


def test_chunks_are_counted_from_one_in_the_plots(pipe):
    generation = _generation(pipe, seconds=1.5)
    assert len(list(generation)) == 3
    times, memory = generation.tables()
    assert list(times["chunk"]) == list(memory["chunk"]) == [1, 2, 3]


def test_stop_ends_the_video_after_the_chunk_being_made(pipe):
    session, generation = DemoSession(), _generation(pipe, seconds=3)  # 6 chunks planned
    assert stop_generation(session) == "Nothing is generating."
    with session.steering(generation):
        chunks = iter(generation)
        next(chunks)
        assert stop_generation(session) == "Stopping after the chunk being made."
        assert list(chunks) == [] and generation.stopped and generation.frames_written == 2


def test_a_prompt_is_stripped_and_an_empty_one_gets_an_example():
    assert parse_prompt(f"  {RED}\n") == RED
    for empty in (None, "", "   "):
        with pytest.raises(DemoInputError, match="^Prompt: type a prompt first, for example “a red circle"):
            parse_prompt(empty)
    with pytest.raises(DemoInputError, match=r"^Switch prompt: type some words, got \['a'\]\.$"):
        parse_prompt(["a"], label="Switch prompt")


@pytest.mark.parametrize(
    ("raw", "steps"),
    [
        ("1000, 750, 500, 250", [1000, 750, 500, 250]),
        ("1000 500", [1000, 500]),
        ("900,", [900]),
        ([1000, 500], [1000, 500]),
    ],
)
def test_denoising_steps_are_read_from_commas_or_spaces_or_a_list(raw, steps):
    assert parse_steps(raw) == steps


@pytest.mark.parametrize("empty", [None, "", "  "])
def test_empty_denoising_steps_mean_the_models_own(empty):
    assert parse_steps(empty) is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("fast", "Denoising steps: type a number, got 'fast'."),
        (750, "Denoising steps: type decreasing numbers from 1000 down"),
    ],
)
def test_bad_denoising_steps_say_what_to_type(raw, message):
    with pytest.raises(DemoInputError) as refused:
        parse_steps(raw)
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("500, 1000", "[500, 1000]"),
        ("1000, 1000", "[1000, 1000]"),
        ("0", "[0]"),  # a chunk starts from noise: the first step is above 0
        ("1000, -5", "[1000, -5]"),
        ("5000", "[5000]"),
        (",", "[]"),
    ],
)
def test_a_step_list_the_pipeline_refuses_is_shown_with_the_fields_label(pipe, model_calls, raw, shown):
    """Which step lists are allowed is the pipeline's rule (`denoising_steps`): the field only reads numbers."""
    assert isinstance(parse_steps(raw), list)
    with pytest.raises(DemoInputError) as refused:
        _generation(pipe, denoising_steps=raw)
    assert str(refused.value) == f"{STEPS_RULE}{shown}."
    assert model_calls == []


def test_a_step_list_the_pipeline_allows_is_taken_as_typed(pipe):
    """Krea's lists end at 0, which the pipeline allows (the demo once refused it with a rule of its own)."""
    assert parse_steps("1000, 937.5, 0") == [1000, 937.5, 0]
    generation = _generation(pipe, denoising_steps="1000, 500, 0")
    assert generation.num_frames == 4


def test_a_video_past_the_rope_table_names_the_length_and_the_position_mode(pipe, model_calls):
    """The model's frame budget, in the page's words: 60 s at 4 fps is 240 latent frames, the tiny table 64."""
    with pytest.raises(DemoInputError) as refused:
        _generation(pipe, seconds=60, position_mode="absolute")
    assert str(refused.value) == (
        "Length (seconds): is 240 latent frames, more than the RoPE table's 64 positions with Position "
        "mode='absolute': make fewer frames, or give Position mode='relative' (positions re-based in place: no "
        "length limit)."
    )
    assert model_calls == []
    assert _generation(pipe, seconds=60, position_mode="relative").num_frames == 240


def test_the_position_mode_is_one_of_the_caches_or_empty():
    assert parse_position_mode("relative") == "relative" and parse_position_mode("") is None
    with pytest.raises(DemoInputError, match=r"^Position mode: choose one of absolute, relative, got 'up'\.$"):
        parse_position_mode("up")


# ---------------------------------------------------------------------------------------- the Advanced section
def test_empty_advanced_fields_are_the_models_own_and_set_ones_are_numbers():
    assert ChunkSettings.parse("", None, " ", "", "") == ChunkSettings()
    assert ChunkSettings.parse("2", 0, "6", "1000, 500", "absolute") == ChunkSettings(
        chunk_frames=2, sink_frames=0, window_frames=6, denoising_steps=[1000, 500], position_mode="absolute"
    )


def test_the_recipe_field_is_a_name_or_empty_and_the_pipeline_says_which_it_has(pipe, model_calls):
    assert parse_recipe("") is None and parse_recipe(None) is None and parse_recipe(" longlive ") == "longlive"
    with pytest.raises(DemoInputError, match=r"^Recipe: pick a recipe's name from the list \(or none\), got 7\.$"):
        parse_recipe(7)
    with pytest.raises(DemoInputError, match=r"^Recipe: must be one of \['causal-forcing', .* got 'nope'\.$"):
        _generation(pipe, recipe="nope")
    assert model_calls == []
    assert _generation(pipe, recipe="infinity-rope").recipe == "infinity-rope"
    assert _generation(pipe).recipe is None  # the tiny model's folder names none


@pytest.mark.parametrize(
    ("recipe", "said"),
    [
        ("rolling-forcing", "whole chunks of 3 latent frames (3 chunks)"),  # 4 chunks in flight: not a chunk of 12
        ("causal-forcing-framewise", "whole chunks of 1 latent frame (8 chunks)"),
    ],
)
def test_the_plan_says_a_chunks_own_length_under_any_recipe(pipe, recipe, said):
    assert said in _generation(pipe, recipe=recipe, seconds=2).plan_note()


def test_the_models_values_are_its_folders_recipes_when_it_names_one():
    """A converted folder names its recipe (`model_index.json`): what a run takes with every field empty is the
    recipe's, not the registered config's."""
    named = tiny_pipeline()
    named.register_to_config(recipe="infinity-rope")
    own = ChunkSettings.of_model(named)
    assert (own.recipe, own.sink_frames, own.window_frames, own.position_mode) == ("infinity-rope", 1, 5, "relative")
    assert ChunkSettings.of_model(named, "self-forcing").window_frames == 21  # a recipe picked wins over the folder's
    plain = ChunkSettings.of_model(tiny_pipeline())
    assert (plain.recipe, plain.sink_frames, plain.window_frames) == (None, 2, 4)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (("0", None, None), "Chunk frames: type a whole number from 1 up, got '0'."),
        ((None, "-1", None), "Sink frames: type a whole number from 0 up, got '-1'."),
        ((None, None, "1.5"), "Window frames: type a whole number from 1 up, got '1.5'."),
    ],
)
def test_a_bad_cache_field_is_named_by_its_label(fields, message):
    with pytest.raises(DemoInputError) as refused:
        ChunkSettings.parse(*fields, None, None)
    assert str(refused.value) == message


# ---------------------------------------------------------------------------------------- the input fields
def _uploaded(path) -> dict:
    """A file record as Gradio hands an upload over (with preprocessing off)."""
    return {"path": str(path), "meta": {"_type": "gradio.FileData"}}


@pytest.fixture
def picture_file(tmp_path):
    path = tmp_path / "start.png"
    PIL.Image.fromarray(np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)).save(path)
    return path


def test_an_uploaded_start_image_is_read_now_as_rgb(picture_file):
    for raw in (_uploaded(picture_file), str(picture_file), picture_file):
        image = parse_image(raw)
        assert image.mode == "RGB" and image.size == (6, 4)
        np.testing.assert_array_equal(np.asarray(image), np.arange(72, dtype=np.uint8).reshape(4, 6, 3))
    array = np.zeros((4, 6, 3), np.uint8)
    assert parse_image(array) is array  # a picture given from Python goes to the pipeline as it is
    assert parse_image(None) is None and parse_image("") is None


def test_a_file_outside_the_upload_folder_is_refused_unread(picture_file, tmp_path):
    """The page passes Gradio's upload folder: a record sent through the API could name any file on the server."""
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    inside = uploads / "start.png"
    inside.write_bytes(picture_file.read_bytes())
    assert parse_image(_uploaded(inside), uploads=str(uploads)).size == (6, 4)
    for parse, label in ((parse_image, "Start image"), (parse_video, "Input video")):
        for outside in (str(picture_file), str(uploads / ".." / "start.png")):
            with pytest.raises(
                DemoInputError, match=rf"^{label}: upload .*; '.*' is not a file uploaded to this demo"
            ):
                parse({"path": outside}, uploads=str(uploads))


def test_a_start_image_that_is_not_a_picture_is_refused_naming_the_field(tmp_path):
    text = tmp_path / "notes.png"
    text.write_text("not a picture")
    with pytest.raises(DemoInputError, match=r"^Start image: 'notes.png' is not a picture PIL can read") as refused:
        parse_image(_uploaded(text))
    assert str(tmp_path) not in str(refused.value) and "'notes.png'" in str(refused.value)  # its own name only
    with pytest.raises(DemoInputError, match=r"^Start image: there is no file at '/no/such.png'; upload a picture"):
        parse_image("/no/such.png")
    with pytest.raises(DemoInputError, match=r"^Start image: upload a picture \(PNG, JPEG or WebP\), got 5\.$"):
        parse_image(5)


def test_an_uploaded_video_is_its_path_and_a_missing_one_is_refused(tmp_path):
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"")  # its contents are the pipeline's to check, as it decodes them
    assert parse_video(_uploaded(clip)) == str(clip) and parse_video(None) is None
    with pytest.raises(DemoInputError, match=r"^Input video: there is no file at '/no/clip.mp4'; upload a video"):
        parse_video(_uploaded("/no/clip.mp4"))
    with pytest.raises(DemoInputError, match=r"^Input video: upload a video file \(mp4, webm, ...\), got \[1\]\.$"):
        parse_video([1])


@pytest.mark.parametrize(("raw", "strength"), [(None, 0.8), ("", 0.8), (0.5, 0.5), ("0.25", 0.25), (1, 1.0)])
def test_strength_is_above_zero_and_at_most_one_empty_is_the_pipelines_default(raw, strength):
    assert parse_strength(raw) == strength


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (0, f"{STRENGTH_RULE}0."),  # the pipeline's range (`check_strength`), with the field's label
        (1.5, f"{STRENGTH_RULE}1.5."),
        (-0.1, f"{STRENGTH_RULE}-0.1."),
        ("strong", "Strength: type a number, got 'strong'."),
        ("nan", "Strength: type a finite number, got 'nan'."),
    ],
)
def test_a_bad_strength_names_the_field_the_range_and_the_value(raw, message):
    with pytest.raises(DemoInputError) as refused:
        parse_strength(raw)
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize("inputs", [{}, {"webcam": True}])
def test_a_strength_the_pipeline_refuses_is_refused_at_generate_with_the_fields_label(inputs):
    """The field is sent with every Generate (an input video or not), so its range is asked when it is read."""
    with pytest.raises(DemoInputError) as refused:
        GenerateFields(prompt=RED, seconds=1, strength="2", **inputs).check(60)
    assert str(refused.value) == f"{STRENGTH_RULE}2.0."


ONE_INPUT = [
    (  # the pipeline's rule (`image` with `video`), relabelled
        dict(image=True, video=True),
        "Start image: give either Start image (image-to-video) or Input video (video-to-video), not both.",
    ),
    (  # the webcam is the pipeline's `video` then
        dict(image=True, webcam=True),
        "Start image: give either Start image (image-to-video) or Webcam (video-to-video), not both.",
    ),
    (  # the demo's own rule: two fields feed the one `video`
        dict(video=True, webcam=True),
        "Input video and Webcam: give one of them, not both (both are the input video): clear the input video or "
        "untick Webcam.",
    ),
    (  # the demo's rule is asked with the fields, before the stream is made
        dict(image=True, video=True, webcam=True),
        "Input video and Webcam: give one of them, not both (both are the input video): clear the input video or "
        "untick Webcam.",
    ),
]


@pytest.mark.parametrize(("given", "message"), ONE_INPUT, ids=["image+video", "image+webcam", "video+webcam", "all"])
def test_an_image_and_a_video_together_are_refused_naming_both(pipe, model_calls, picture_file, given, message):
    raw = dict(
        image=_uploaded(picture_file) if given.get("image") else None,
        video=_uploaded(picture_file) if given.get("video") else None,  # any file: the pipeline reads it
        webcam=given.get("webcam", False),
    )
    with pytest.raises(DemoInputError) as refused:
        _generation(pipe, **raw)
    assert str(refused.value) == message
    assert model_calls == []


def test_the_webcam_field_is_a_checkbox():
    assert InputConfig.parse(None, None, None, None) == InputConfig()
    assert InputConfig.parse(None, None, True, 0.5) == InputConfig(webcam=True, strength=0.5)
    with pytest.raises(DemoInputError, match=r"^Webcam: send true or false, got 'yes'\.$"):
        InputConfig.parse(None, None, "yes", None)


def test_the_inputs_become_the_pipelines_image_or_video_and_strength(picture_file):
    assert InputConfig().stream_arguments() == {} and InputConfig().kind == "text"
    image = InputConfig.parse(str(picture_file), None, False, 0.3)
    assert image.kind == "image" and list(image.stream_arguments()) == ["image"]  # no strength without a video
    clip = InputConfig(video="clip.mp4", strength=0.3)
    assert clip.kind == "clip" and clip.stream_arguments() == {"video": "clip.mp4", "strength": 0.3}
    frames = iter([])
    webcam = InputConfig(webcam=True)
    assert webcam.kind == "webcam" and webcam.stream_arguments(frames) == {"video": frames, "strength": 0.8}
    with pytest.raises(ValueError, match="pass its frames as `webcam_frames`"):
        webcam.stream_arguments()


# ---------------------------------------------------------------------------------------- the pipeline's words
def test_relabel_starts_with_the_field_and_names_every_argument_by_its_label():
    assert str(relabel(ValueError("`strength` must be a number in (0, 1], got 0."))) == (
        "Strength: must be a number in (0, 1], got 0."
    )
    assert str(relabel(ValueError("`window_frames`=2 must be larger than `chunk_frames`=2."))) == (
        "Window frames: 2 must be larger than Chunk frames=2."
    )
    assert str(relabel(ValueError("Give either `image` or `video`, not both."))) == (
        "Start image: give either Start image or Input video, not both."
    )
    webcam = {**FIELD_LABELS, "video": "Webcam"}
    assert str(relabel(ValueError("`video` has 1 frames."), webcam)) == "Webcam: has 1 frames."
    assert str(relabel(ValueError("`output_type` is not a field."))) == "`output_type` is not a field."
    ours = DemoInputError("Seed: type a number, got 'x'.")
    assert relabel(ours) is ours and isinstance(relabel(ValueError("`prompt` x")), DemoInputError)


def test_every_argument_the_demo_sets_has_a_label():
    brief = {"prompt", "prompt_schedule", "strength", "image", "video", "denoising_steps", "chunk_frames"}
    brief |= {"sink_frames", "window_frames", "position_mode", "height", "width", "num_frames"}
    assert brief <= set(FIELD_LABELS)
    assert set(FIELD_LABELS) - {"seconds"} <= set(VideoCall.names())  # the pipeline's own argument names


def test_a_prompt_the_tokenizer_cannot_read_is_refused_with_the_fields_label(pipe, model_calls):
    with pytest.raises(DemoInputError) as refused:
        _generation(pipe, prompt="xyzzy plugh")
    assert str(refused.value).startswith(
        "Prompt: 'xyzzy plugh' has no word the tokenizer knows (unknown: 'xyzzy', 'plugh'); it would generate"
    )
    assert model_calls == []


def test_a_prompt_warning_is_issued_once_per_generate(pipe):
    """The pipeline checks the prompt once, as the stream is made; its warnings are the video's notes."""
    note = f"`prompt` {ZIGZAG!r}: 1 word(s) unknown to the tokenizer are ignored: 'zigzag'."
    with warnings.catch_warnings(record=True) as issued:
        warnings.simplefilter("always")  # every issue counted, none folded into one
        generation = _generation(pipe, prompt=ZIGZAG)
    assert [str(w.message) for w in issued if issubclass(w.category, PromptWarning)] == [note]
    assert generation.notes == [note]


def test_another_threads_prompt_warnings_are_not_this_generates_notes():
    """Sessions make their streams in threads of their own: one session's words never become another's notes."""
    with warnings.catch_warnings(record=True) as issued:
        warnings.simplefilter("always")
        with prompt_warnings() as notes:
            other = threading.Thread(target=warnings.warn, args=("another session's", PromptWarning))
            other.start()
            other.join()
            warnings.warn("this one's", PromptWarning, stacklevel=1)
            warnings.warn("not about a prompt", UserWarning, stacklevel=1)
        with prompt_warnings(show=False) as unshown:
            warnings.warn("checked again later", PromptWarning, stacklevel=1)
    assert notes == ["this one's"] and unshown == ["checked again later"]
    assert sorted(str(w.message) for w in issued) == ["another session's", "not about a prompt", "this one's"]


# ---------------------------------------------------------------------------------------- the whole form
def test_the_form_checks_into_one_config_with_the_demos_defaults():
    config = GenerateFields(prompt=f" {RED} ", seconds="3", chunk_frames="1").check(max_seconds=60)
    assert config == GenerateConfig(
        prompt=RED, seconds=3.0, seed=0, model=None, settings=ChunkSettings(chunk_frames=1)
    )
    assert GenerateFields(RED, 1, MAX_SEED, "sana").check(60).model == "sana"


def test_the_forms_fields_are_the_generate_apis_arguments_the_later_ones_last():
    assert GenerateFields.names() == [
        "prompt", "seconds", "seed", "model", "chunk_frames", "sink_frames", "window_frames", "denoising_steps",
        "position_mode", "image", "video", "webcam", "strength", "recipe",
    ]  # fmt: skip


def test_the_first_bad_field_in_the_pages_order_is_the_one_named():
    form = GenerateFields(prompt=RED, seconds="long", seed=-1, chunk_frames=0)
    with pytest.raises(DemoInputError, match=r"^Length \(seconds\): type a number, got 'long'\.$"):
        form.check(60)


def test_the_form_is_frozen():
    form = GenerateFields(prompt=RED, seconds=1)
    with pytest.raises(AttributeError):
        form.seconds = 2


@pytest.mark.parametrize("setting", ["fps", "max_seconds", "max_concurrency"])
@pytest.mark.parametrize("value", [0, -2, 2.5, True, "16"])
def test_a_bad_demo_setting_names_the_argument(setting, value):
    with pytest.raises(ValueError, match=rf"^`{setting}` must be a positive whole number, got {value!r}\.$"):
        DemoSettings(**{setting: value})


# ---------------------------------------------------------------------------------------- the address check
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "localhost"])
def test_an_address_of_this_machine_on_a_free_port_is_accepted_and_left_free(host):
    port = _free_port()
    check_address(host, port)
    with socket.socket() as server:  # the check released what it bound: the server can take it
        server.bind(("127.0.0.1", port))


BAD_ADDRESSES = {
    "port-too-big": ("127.0.0.1", 70000, "`port` must be a whole number from 1 to 65535, got 70000."),
    "port-zero": ("127.0.0.1", 0, "`port` must be a whole number from 1 to 65535, got 0."),
    "host-empty": ("", 7860, "`host` must be an address of this machine such as 127.0.0.1 or 0.0.0.0, got ''."),
    "host-not-ipv4": ("999.1.1.1", 7860, "`host` '999.1.1.1' is not a valid IPv4 address (four numbers 0-255)."),
    "host-unresolvable": ("no-such-host.invalid", 7860, "`host` 'no-such-host.invalid' is not an address or a name"),
    "host-label-too-long": ("a" * 64 + ".com", 7860, f"`host` '{'a' * 64}.com' is not an address or a name"),
    "host-not-this-machine": ("192.0.2.1", 7860, "cannot serve on `host` '192.0.2.1' `port` 7860:"),
}


@pytest.mark.parametrize(("host", "port", "message"), BAD_ADDRESSES.values(), ids=BAD_ADDRESSES.keys())
def test_the_demo_and_the_command_refuse_an_address_with_the_same_words(host, port, message, monkeypatch, capsys):
    with pytest.raises(ValueError) as refused:
        check_address(host, port)
    assert str(refused.value).startswith(message)

    monkeypatch.setattr("rolldiff.demo.build_demo", lambda *a, **k: pytest.fail("the demo was built"))
    assert main(["demo", "--host", host, "--port", str(port)]) == 2
    as_flags = message.replace("`host`", "--host").replace("`port`", "--port")
    assert capsys.readouterr().err.startswith(f"rolldiff: error: {as_flags}")


def test_a_port_in_use_is_refused_by_both_with_the_same_words(monkeypatch, capsys):
    monkeypatch.setattr("rolldiff.demo.build_demo", lambda *a, **k: pytest.fail("the demo was built"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"^cannot serve on `host` '127.0.0.1' `port` {port}: Address already"):
            check_address("127.0.0.1", port)
        assert main(["demo", "--port", str(port)]) == 2
    assert f"cannot serve on --host '127.0.0.1' --port {port}: Address already in use" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- no UI below the page
def test_the_checks_and_the_session_logic_import_without_gradio():
    """Only `rolldiff.demo.page` imports Gradio: the rest runs (and is tested) without a UI."""
    code = "import sys, rolldiff.demo.session, rolldiff.demo.fields, rolldiff.demo.serving; print('gradio' in sys.modules)"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "False"

"""The Gradio demo, served headless and driven with `gradio_client`: streamed chunks, live prompt switch, isolation,
the per-chunk plots, the Advanced settings, the model menu and the checks of every field.

The tiny random pipeline makes 2 frames per chunk at 16x16; the demo runs at 4 fps so a second is 2 chunks.
Each chunk is encoded as its own mp4 segment, so equal chunks give byte-equal segments and the decoded videos of
two runs can be compared exactly.
"""

import re
import socket
import time
import warnings
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import PIL.Image
import pytest
import torch
from gradio_client import Client
from gradio_client.exceptions import AppError
from test_long_sana_pipeline import tiny_sana_pipeline
from tiny_components import tiny_pipeline

from rolldiff.defaults import embedded_models, load_pipeline, native_size
from rolldiff.demo import (
    DEFAULT_SEED,
    EXAMPLE_PROMPTS,
    ChunkSettings,
    GenerateFields,
    LivePrompt,
    build_demo,
    check_address,
    generate_frames,
    launch,
    prompt_notes,
    streaming_available,
)
from rolldiff.pipelines.io.video_writer import frames_to_uint8
from rolldiff.pipelines.request.text_encoding import PromptWarning
from rolldiff.toyworld import parse_prompt as parse_scene
from rolldiff.toyworld.metrics import COLOUR_INDEX, palette_labels

FPS = 4
RED, BLUE, GREEN = "a red circle moving left", "a blue square moving up", "a green triangle moving right"


def _read(path) -> np.ndarray:
    return iio.imread(path, plugin="FFMPEG", index=None)  # (frames, height, width, 3) uint8


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def sana_pipe():
    return tiny_sana_pipeline()  # the SANA-like family: linear-attention state, every earlier chunk seen


def _serve(streaming: bool = False, **kwargs):
    demo = build_demo(max_concurrency=2, height=16, width=16, fps=FPS, streaming=streaming, **kwargs)
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=_free_port(), quiet=True)
    return demo


@pytest.fixture(scope="module")
def server(pipe):
    demo = _serve(pipeline=pipe)  # the whole mp4 so far after each chunk: comparable frame by frame
    yield demo
    demo.close()


def _client(server) -> Client:
    return Client(server.local_url, verbose=False)  # one client = one browser session


@pytest.fixture
def slow_chunks(pipe):
    """Slow the transformer down so a client can act between two chunks of one video."""
    handle = pipe.transformer.register_forward_pre_hook(lambda *args: time.sleep(0.05))
    yield
    handle.remove()


def _wait_for_first_chunk(job, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not job.outputs():
        assert not job.done() and time.monotonic() < deadline, "the generation sent no chunk"
        time.sleep(0.02)


def _plot_data(plot: dict) -> list[list[float]]:
    """`[[chunk, value], ...]` of a plot output (sent bare, or inside an update that also sets its y range)."""
    return plot.get("value", plot)["data"]


def _plot_values(plot: dict) -> list[float]:
    return [value for _, value in _plot_data(plot)]


def _chunk_outputs(job) -> list:
    """The outputs sent after each chunk: not the first (the plan, before any chunk) nor the last (the finished
    video)."""
    return job.outputs()[1:-1]


def _preview_frames(output) -> int:
    """How many frames the live preview (an animated GIF of the chunk) sent with one chunk's outputs shows."""
    with PIL.Image.open(output[4]) as picture:
        return picture.n_frames


def _as_uint8(chunks) -> np.ndarray:
    return (np.concatenate([c[0] for c in chunks]) * 255.0).round().clip(0, 255).astype(np.uint8)


# ---------------------------------------------------------------------------------------- streaming and switching
def test_generate_yields_the_video_so_far_after_every_chunk(server):
    job = _client(server).submit(RED, 2, 0, api_name="/generate")  # 2 s at 4 fps: 8 frames, 4 chunks
    video, summary, *_, details = job.result()
    assert [_preview_frames(output) for output in _chunk_outputs(job)] == [2, 2, 2, 2]  # each chunk, as it comes
    assert all(not isinstance(output[0], str) for output in job.outputs()[:-1])  # the player is not re-created
    assert _read(video).shape == (8, 16, 16, 3)
    assert details["frames"] == "8 / 8" and details["prompt_schedule"] == [[0, RED]]
    assert "frames per second" in summary


def test_switching_the_prompt_mid_run_changes_the_frames_after_the_switch(server, slow_chunks):
    client = _client(server)
    plain = _read(client.predict(RED, 2, 0, api_name="/generate")[0])
    job = client.submit(RED, 2, 0, api_name="/generate")  # 8 frames, 4 chunks
    _wait_for_first_chunk(job)
    assert client.predict(BLUE, api_name="/switch_prompt").startswith("Switching")
    video, *_, details = job.result()

    (_, first), (switch_frame, second) = details["prompt_schedule"]
    assert (first, second) == (RED, BLUE) and 0 < switch_frame < 8
    switched = _read(video)
    np.testing.assert_array_equal(switched[:switch_frame], plain[:switch_frame])
    assert not np.array_equal(switched[switch_frame:], plain[switch_frame:])


def test_a_switch_only_steers_its_own_session(server, slow_chunks):
    job = _client(server).submit(RED, 2, 0, api_name="/generate")
    _wait_for_first_chunk(job)
    assert _client(server).predict(BLUE, api_name="/switch_prompt").startswith("Nothing is generating")
    assert job.result()[-1]["prompt_schedule"] == [[0, RED]]


def test_concurrent_sessions_each_get_the_video_they_get_alone(server):
    requests = [(RED, 2, 1), (GREEN, 2, 2)]
    alone = [_read(_client(server).predict(*request, api_name="/generate")[0]) for request in requests]
    jobs = [_client(server).submit(*request, api_name="/generate") for request in requests]
    together = [_read(job.result()[0]) for job in jobs]
    assert not np.array_equal(alone[0], alone[1])
    for got, expected in zip(together, alone):  # to rounding (see tests/concurrency.py); another's video differs
        assert np.abs(got.astype(int) - expected.astype(int)).mean() < 1


@pytest.mark.parametrize("family", ["pipe", "sana_pipe"])
def test_live_switch_equals_the_pipelines_prompt_schedule_at_the_recorded_frame(family, request):
    pipe = request.getfixturevalue(family)
    live = LivePrompt(RED)
    chunks = []
    for chunk in generate_frames(pipe, live, 8, 16, 16, seed=0):
        chunks.append(chunk.frames)
        if len(chunks) == 1:
            live.switch(BLUE)
    assert live.applied == [(0, RED), (2, BLUE)]  # taken at the next chunk, which starts at frame 2

    expected = pipe.stream(None, 8, 16, 16, prompt_schedule=live.applied, generator=torch.Generator().manual_seed(0))
    np.testing.assert_array_equal(np.concatenate(chunks), _as_uint8(expected))
    unswitched = pipe.stream(RED, 8, 16, 16, generator=torch.Generator().manual_seed(0))
    assert not np.array_equal(np.concatenate(chunks), _as_uint8(unswitched))  # the switch did something


def test_a_live_cut_equals_the_pipelines_scene_cuts_at_the_recorded_frame(pipe):
    """`LivePrompt.switch(..., scene_cut=True)` lands as a `prompt_schedule` switch named in `scene_cuts`, and
    `cuts` records its frame; the same switch without the cut makes other frames."""
    relative = ChunkSettings(position_mode="relative")

    def run(scene_cut: bool) -> tuple[np.ndarray, LivePrompt]:
        live, chunks = LivePrompt(RED), []
        for chunk in generate_frames(pipe, live, 8, 16, 16, seed=0, settings=relative):
            chunks.append(chunk.frames)
            if len(chunks) == 1:
                live.switch(BLUE, scene_cut=scene_cut)
        return np.concatenate(chunks), live

    cut, live = run(True)
    assert live.applied == [(0, RED), (2, BLUE)] and live.cuts == [2]
    expected = pipe.stream(None, 8, 16, 16, prompt_schedule=live.applied, scene_cuts=live.cuts,
                           position_mode="relative", generator=torch.Generator().manual_seed(0))  # fmt: skip
    np.testing.assert_array_equal(cut, _as_uint8(expected))
    switched, plain_live = run(False)
    assert plain_live.cuts == [] and not np.array_equal(cut, switched)


def test_a_recipe_picked_on_the_page_runs_it_and_lets_a_cut_land(server, slow_chunks):
    """The tiny model's own positions are absolute (a cut is refused: the next test); under the Recipe
    "infinity-rope" (relative, sink 1 + window 5) a live cut lands and the run says which recipe it ran."""
    client = _client(server)
    job = client.submit(RED, 3, 0, recipe="infinity-rope", api_name="/generate")
    _wait_for_first_chunk(job)
    status = client.predict(BLUE, api_name="/cut_to_prompt")
    details, plan = job.result()[-1], job.outputs()[0][5]  # the plan comes before the first chunk
    assert status.startswith("Cutting to") and details["recipe"] == "infinity-rope"
    assert "Recipe: infinity-rope (the Advanced fields you set win)." in plan
    (_, first), (switch, second) = details["prompt_schedule"]
    assert (first, second) == (RED, BLUE) and details["scene_cuts"] == [switch]


def test_a_recipe_and_a_field_set_beside_it_give_the_librarys_video_for_them(pipe):
    """The Recipe field is `recipe=`: its settings apply, a field set beside it wins, a live cut lands as
    `scene_cuts` (bit for bit the library's frames)."""
    settings = ChunkSettings(recipe="infinity-rope", denoising_steps=[1000, 500])
    live, chunks = LivePrompt(RED), []
    for chunk in generate_frames(pipe, live, 12, 16, 16, seed=0, settings=settings):
        chunks.append(chunk.frames)
        if len(chunks) == 2:
            live.switch(BLUE, scene_cut=True)
    assert live.cuts == [6] and [len(frames) for frames in chunks] == [3] * 4  # the recipe's chunks of 3
    expected = pipe.stream(None, 12, 16, 16, prompt_schedule=live.applied, scene_cuts=live.cuts,
                           recipe="infinity-rope", denoising_steps=[1000, 500],
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    np.testing.assert_array_equal(np.concatenate(chunks), _as_uint8(expected))
    default = pipe.stream(RED, 12, 16, 16, recipe="infinity-rope", generator=torch.Generator().manual_seed(0))
    assert not np.array_equal(np.concatenate(chunks[:2]), _as_uint8(default)[:6])  # the steps field won


def test_picking_a_recipe_shows_its_values_as_the_fields_placeholders(server):
    client = _client(server)
    chunk, sink, window, steps, mode = client.predict("pipeline", "infinity-rope", api_name="/select_recipe")
    assert (sink["placeholder"], window["placeholder"]) == ("1 (the recipe's)", "5 (the recipe's)")
    assert steps["placeholder"] == "1000, 750, 500, 250 (the recipe's)"
    assert mode["choices"][0] == ["the recipe's (relative)", ""]
    chunk, sink, *_ = client.predict("pipeline", "", api_name="/select_recipe")
    assert sink["placeholder"].endswith("(the model's)")


def test_a_cut_the_videos_settings_cannot_make_is_refused_and_the_video_goes_on(server, slow_chunks):
    client = _client(server)
    job = client.submit(RED, 2, 0, api_name="/generate")  # the tiny model's absolute positions
    _wait_for_first_chunk(job)
    status = client.predict(BLUE, api_name="/cut_to_prompt")
    assert status.startswith("Not cutting: `scene_cut` places a cut chunk") and "position_mode='absolute'" in status
    details = job.result()[-1]
    assert details["prompt_schedule"] == [[0, RED]] and details["scene_cuts"] == []


def test_a_switch_once_the_last_chunk_has_started_is_refused(pipe):
    live = LivePrompt(RED)
    chunks = generate_frames(pipe, live, 8, 16, 16, seed=0)  # 4 chunks, the last one starts at frame 6
    for _ in range(3):
        next(chunks)
    assert live.switch(BLUE)  # the loop has not asked for chunk 4 yet: it lands there
    next(chunks)
    assert not live.switch(GREEN)  # nothing left to steer
    assert next(chunks, None) is None and live.applied == [(0, RED), (6, BLUE)]


@pytest.mark.skipif(not streaming_available(), reason="Gradio's streaming video output needs ffmpeg and ffprobe")
def test_streaming_output_sends_one_hls_segment_per_chunk(pipe):
    demo = _serve(pipeline=pipe, streaming=True)
    try:
        job = _client(demo).submit(RED, 2, 0, api_name="/generate")  # 4 chunks of 2 frames at 4 fps
        playlist = Path(job.result()[0]).read_text()
    finally:
        demo.close()
    assert len(job.outputs()) == 5  # the plan, then one segment per chunk
    assert playlist.count("#EXTINF:0.5") == 4 and playlist.rstrip().endswith("#EXT-X-ENDLIST")


def test_unknown_words_are_reported_with_the_video(server, recwarn):
    details = _client(server).predict("a red circle moving zigzag", 1, 0, api_name="/generate")[-1]
    note = "`prompt` 'a red circle moving zigzag': 1 word(s) unknown to the tokenizer are ignored: 'zigzag'."
    assert details["prompt_notes"] == [note]
    # the pipeline's check, once per Generate (the server log gets it once; the notes are what it said)
    assert [str(w.message) for w in recwarn if issubclass(w.category, PromptWarning)] == [note]


def test_a_live_switch_to_unknown_words_is_noted_now_and_warned_once_as_it_lands(pipe):
    zigzag = "a red circle moving zigzag"
    live = LivePrompt(RED)
    chunks = generate_frames(pipe, live, 8, 16, 16, seed=0)
    next(chunks)
    with warnings.catch_warnings(record=True) as issued:
        warnings.simplefilter("always")
        notes = prompt_notes(pipe, zigzag, "switch prompt")  # the pipeline's check, recorded, not issued
        assert live.switch(zigzag, notes)
        assert len(list(chunks)) == 3
    assert notes == [f"`switch prompt` {zigzag!r}: 1 word(s) unknown to the tokenizer are ignored: 'zigzag'."]
    landed = [str(w.message) for w in issued if issubclass(w.category, PromptWarning)]
    assert landed == [f"`prompt` {zigzag!r}: 1 word(s) unknown to the tokenizer are ignored: 'zigzag'."]


def test_a_switch_to_a_prompt_of_unknown_words_is_refused_and_the_video_goes_on(server, slow_chunks):
    client = _client(server)
    job = client.submit(RED, 2, 0, api_name="/generate")
    _wait_for_first_chunk(job)
    status = client.predict("xyzzy plugh", api_name="/switch_prompt")
    assert status.startswith("Not switching: `switch prompt` 'xyzzy plugh' has no word the tokenizer knows")
    assert job.result()[-1]["prompt_schedule"] == [[0, RED]]


# ---------------------------------------------------------------------------------------- the live plots
def test_each_chunk_plots_its_time_and_a_flat_cache_memory(server):
    job = _client(server).submit(RED, 3, 0, api_name="/generate")  # 12 frames: 6 chunks, window full after 2
    *_, details = job.result()
    _, summary, times, memory, *_ = _chunk_outputs(job)[-1]
    assert [len(_plot_data(output[2])) for output in _chunk_outputs(job)] == list(range(1, 7))  # grow live
    assert [len(_plot_data(output[3])) for output in _chunk_outputs(job)] == list(range(1, 7))
    assert [chunk for chunk, _ in _plot_data(times)] == list(range(1, 7))  # counted from 1, as the status line
    assert "chunk 6 of 6 took" in summary
    assert all(ms > 0 for ms in _plot_values(times))
    cache_kib = _plot_values(memory)
    assert cache_kib[0] > 0 and cache_kib == [cache_kib[0]] * 6  # preallocated ring buffers: a flat line
    assert round(details["cache_bytes"] / 1024, 2) == cache_kib[0]
    shown = re.search(r"([0-9.]+) frames per second", summary)
    assert details["frames_per_second"] > 0 and shown is not None
    assert abs(float(shown.group(1)) - details["frames_per_second"]) <= 0.05 + 1e-9  # one decimal, rounded once


def test_the_memory_plot_reads_the_running_cache(server):
    """A longer window (Advanced) holds more tokens: the plotted bytes follow the cache actually used. 2 s (8
    latent frames) fill both windows: a window past the video would be shortened to what the video fills."""
    client = _client(server)
    default = client.predict(RED, 2, 0, api_name="/generate")[-1]["cache_bytes"]
    longer = client.predict(RED, 2, 0, window_frames=6, api_name="/generate")[-1]["cache_bytes"]
    sink_tokens, window_tokens = 2, 4  # the tiny pipeline's sink and window, in latent frames
    assert longer > default
    assert longer - default == pytest.approx(default * 2 / (sink_tokens + window_tokens), rel=0.25)


# ---------------------------------------------------------------------------------------- Advanced settings
def test_advanced_settings_give_the_pipelines_own_video_for_them(pipe):
    settings = ChunkSettings(
        chunk_frames=1, sink_frames=1, window_frames=3, denoising_steps=[1000, 500], position_mode="relative"
    )
    live = LivePrompt(GREEN)
    got = [c.frames for c in generate_frames(pipe, live, 6, 16, 16, seed=3, settings=settings)]
    assert [len(frames) for frames in got] == [1] * 6  # one latent frame per chunk (this VAE has no time factor)
    kwargs = dict(
        chunk_frames=1, sink_frames=1, window_frames=3, denoising_steps=[1000, 500], position_mode="relative"
    )
    expected = pipe.stream(GREEN, 6, 16, 16, generator=torch.Generator().manual_seed(3), **kwargs)
    np.testing.assert_array_equal(np.concatenate(got), _as_uint8(expected))


def test_advanced_fields_reach_the_generation(server):
    client = _client(server)
    job = client.submit(RED, 1, 0, None, 1, 1, 3, "1000, 500", "relative", api_name="/generate")
    video = job.result()[0]
    assert [_preview_frames(output) for output in _chunk_outputs(job)] == [1, 1, 1, 1]  # chunks of one frame
    assert not np.array_equal(_read(video), _read(client.predict(RED, 1, 0, api_name="/generate")[0]))


# ---------------------------------------------------------------------------------------- every field checked
BAD_FIELDS = [
    (dict(seconds="abc"), "Length (seconds): type a number, got 'abc'"),
    (dict(seconds=-1), "Length (seconds): type a number above 0 and at most 60"),
    (dict(seconds=0), "Length (seconds)"),
    (dict(seconds="inf"), "Length (seconds): type a finite number"),
    (dict(seconds="nan"), "Length (seconds): type a finite number"),
    (dict(seconds=True), "Length (seconds): type a number, got True"),
    (dict(seed=-1), "Seed: type a whole number from 0 to 4294967295, got -1"),
    (dict(seed=2.5), "Seed: type a whole number"),
    (dict(seed="x"), "Seed: type a number"),
    (dict(seed=2**40), "Seed: type a whole number from 0 to 4294967295"),
    (dict(prompt="   "), "Prompt: type a prompt first"),
    (dict(prompt=5), "Prompt: type some words, got 5"),
    (dict(prompt="xyzzy plugh"), "Prompt: 'xyzzy plugh' has no word the tokenizer knows"),  # the pipeline's rule
    (dict(model="no-such-model"), "Model: choose one of pipeline, got 'no-such-model'"),
    (dict(chunk_frames=0), "Chunk frames: type a whole number from 1 up, got 0"),
    (dict(chunk_frames="two"), "Chunk frames: type a number, got 'two'"),
    (dict(sink_frames=-1), "Sink frames: type a whole number from 0 up, got -1"),
    (dict(window_frames=2), "Window frames: 2 must be larger than Chunk frames=2"),  # the pipeline's check
    (dict(denoising_steps="1000, 1000"), "Denoising steps: must be strictly decreasing numbers in [0, 1000]"),
    (
        dict(denoising_steps="5000"),  # the pipeline's check: what is allowed, and what was typed
        "Denoising steps: must be strictly decreasing numbers in [0, 1000], the first above 0 (a chunk starts from "
        "noise; only the last may be 0), e.g. [1000, 750, 500, 250]; got [5000].",
    ),
    (dict(denoising_steps="fast"), "Denoising steps: type a number, got 'fast'"),
    (dict(position_mode="sideways"), "Position mode: choose one of absolute, relative, got 'sideways'"),
    (dict(recipe=3), "Recipe: pick a recipe's name from the list (or none), got 3"),
    (  # the pipeline's rule: the recipes of this pipeline class, by name
        dict(recipe="longsana"),
        "Recipe: must be one of ['causal-forcing', 'causal-forcing-1step', 'causal-forcing-2step', "
        "'causal-forcing-framewise', 'infinity-rope', 'krea-realtime', 'longlive', 'reward-forcing', "
        "'rolling-forcing', 'rolling-sink', 'self-forcing', 'streamdiffusionv2'] for KreaRealtimeVideoPipeline, "
        "got 'longsana'.",
    ),
]


@pytest.mark.parametrize(("fields", "message"), BAD_FIELDS, ids=[str(fields) for fields, _ in BAD_FIELDS])
def test_a_bad_field_is_refused_before_any_work(server, model_calls, fields, message):
    arguments = {"prompt": RED, "seconds": 1, "seed": 0, **fields}
    with pytest.raises(AppError) as refused:
        _client(server).predict(**arguments, api_name="/generate")
    assert message in str(refused.value)
    assert model_calls == []


@pytest.mark.parametrize(("height", "width"), [(15, 16), (16, 0), (-16, 16), (16, 24.0)])
def test_a_frame_size_the_model_cannot_make_is_refused_when_the_demo_is_built(pipe, height, width):
    with pytest.raises(ValueError, match=r"`height`=.*`width`=.*must be a positive multiple of 8"):
        build_demo(pipeline=pipe, height=height, width=width)


@pytest.mark.parametrize(
    ("setting", "value"), [("fps", 0), ("fps", 2.5), ("max_seconds", -1), ("max_concurrency", True)]
)
def test_a_bad_demo_setting_is_refused_before_a_model_loads(setting, value):
    with pytest.raises(ValueError, match=rf"`{setting}` must be a positive whole number, got {value!r}"):
        build_demo(models={"never loaded": lambda: pytest.fail("a model was loaded")}, **{setting: value})


def test_an_unknown_demo_setting_is_refused_before_a_model_loads():
    with pytest.raises(TypeError, match=r"build_demo\(\) got unexpected argument\(s\) \['fsp'\]; its settings are"):
        build_demo(models={"never loaded": lambda: pytest.fail("a model was loaded")}, fsp=4)


def test_the_generate_api_takes_the_forms_fields_by_name(server):
    api = _client(server).view_api(return_format="dict", print_info=False)["named_endpoints"]
    assert [p["parameter_name"] for p in api["/generate"]["parameters"]] == GenerateFields.names()
    assert [p["parameter_name"] for p in api["/switch_prompt"]["parameters"]] == ["prompt"]
    assert [p["parameter_name"] for p in api["/cut_to_prompt"]["parameters"]] == ["prompt"]


@pytest.mark.parametrize("port", [70000, 0, -1, "7860", True, 80.5])
def test_launch_refuses_a_bad_port_before_starting(port):
    with pytest.raises(ValueError, match=rf"`port` must be a whole number from 1 to 65535, got {port!r}"):
        launch(object(), port=port)  # never reaches the (fake) demo


@pytest.mark.parametrize(
    ("host", "message"),
    [
        ("999.1.1.1", "`host` '999.1.1.1' is not a valid IPv4 address"),
        ("", "`host` must be an address of this machine"),
        (None, "`host` must be an address of this machine"),
        ("192.0.2.1", "cannot serve on `host` '192.0.2.1'"),  # a documentation address, not this machine's
    ],
)
def test_launch_refuses_a_host_it_cannot_serve_on(host, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        launch(object(), host=host, port=_free_port())


def test_a_port_in_use_is_named_before_starting():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(
            ValueError, match=f"cannot serve on `host` '127.0.0.1' `port` {port}: Address already in use"
        ):
            check_address("127.0.0.1", port)
    check_address("127.0.0.1", _free_port())


# ---------------------------------------------------------------------------------------- models
def test_the_model_menu_switches_between_model_families(pipe, sana_pipe):
    demo = _serve(models={"krea": pipe, "sana": sana_pipe})
    try:
        client = _client(demo)
        info, chunk, sink, window, steps, mode, recipe = client.predict("sana", api_name="/select_model")
        job = client.submit(RED, 1, 0, "sana", api_name="/generate")
        video, *_, details = job.result()
        krea = client.predict(RED, 1, 0, "krea", api_name="/generate")
    finally:
        demo.close()
    assert info == "LongSanaVideoPipeline, 16x16 pixels"
    assert window["placeholder"] == "every earlier frame (the model's)"  # LongSANA's unbounded window
    assert recipe["choices"] == [["the model's own settings", ""], ["longsana", "longsana"]]  # SANA's recipes only
    assert details["model"] == "sana" and krea[-1]["model"] == "krea"
    assert [_preview_frames(output) for output in _chunk_outputs(job)] == [2, 2] and len(_read(video)) == 4
    assert not np.array_equal(_read(video), _read(krea[0]))


@pytest.fixture(scope="module")
def embedded_server():
    demo = build_demo(fps=FPS, streaming=False)  # every embedded model, each loaded when first chosen
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=_free_port(), quiet=True)
    yield demo
    demo.close()


@pytest.mark.parametrize("name", list(embedded_models()))
def test_each_embedded_model_can_be_chosen_and_generates(embedded_server, name):
    client = _client(embedded_server)
    info, *placeholders = client.predict(name, api_name="/select_model")
    assert f"{type(load_pipeline(name, device='cpu')).__name__}, 32x32" in info
    video, *_, details = client.predict(RED, 1, 0, name, api_name="/generate")
    assert details["model"] == name and _read(video).shape[1:] == (32, 32, 3)


def test_the_default_model_comes_first_in_the_menu(embedded_server):
    assert list(embedded_models())[0] == "tiny-bouncing-shapes"
    assert _client(embedded_server).predict(RED, 1, 0, api_name="/generate")[-1]["model"] == "tiny-bouncing-shapes"


@pytest.mark.parametrize("name", list(embedded_models()))
def test_every_example_prompt_starts_right_on_the_embedded_models_at_the_default_seed(name):
    """The tiny models' first frames are their weak spot ("a green triangle moving right" at seed 0 opens with
    empty frames): each example prompt's first 2 chunks, at the page's default seed, show the prompt's colour."""
    pipe = load_pipeline(name, device="cpu")
    pipe.set_progress_bar_config(disable=True)
    height, width = native_size(pipe)
    for prompt in EXAMPLE_PROMPTS:
        stream = iter(pipe.stream(prompt, pipe.num_frames_for(1, 16), height, width, generator=_seeded(DEFAULT_SEED)))
        frames = frames_to_uint8(np.concatenate([next(stream)[0], next(stream)[0]]))
        labels, _ = palette_labels(frames)
        wanted = COLOUR_INDEX[parse_scene(prompt).colour]
        for index, frame in enumerate(labels):
            shape = int((frame != 0).sum())
            assert shape >= 20 and (frame == wanted).sum() >= 0.8 * shape, f"{prompt!r}: frame {index} is off"


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator("cpu").manual_seed(seed)

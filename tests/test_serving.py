"""`rolldiff serve` as users meet it: a real process on 127.0.0.1, real WebSocket clients, the protocol
`rolldiff-stream/1` message by message. Every loop that waits is bounded in count and time."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import numpy as np
import PIL.Image
import pytest
from serve_helpers import (
    ANNOUNCED,
    FRAMES,
    RED,
    Server,
    free_port,
    killed_then_restored,
    library_references,
    max_difference,
    round_robin,
)
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from rolldiff.cli import main
from rolldiff.serving import ProtocolError, connect, restore

BLUE = "a blue square moving up"


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sessions")


@pytest.fixture(scope="module")
def server(state_dir):
    server = Server("--state-dir", str(state_dir), "--max-sessions", "3")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return library_references(tmp_path_factory.mktemp("references"))


def _raw(url: str):
    return ws_connect(url, max_size=None, open_timeout=30)


def _messages_until_close(socket, limit: int = 200) -> tuple[list, int | None]:
    """Every text message until the server closes (at most `limit`), and the close code."""
    messages = []
    try:
        for _ in range(limit):
            message = socket.recv(timeout=30)
            if isinstance(message, str):
                messages.append(json.loads(message))
    except ConnectionClosed as closed:
        return messages, closed.rcvd.code if closed.rcvd else None
    return messages, None


# ---------------------------------------------------------------------------------------- a session is the video
def test_http_beside_the_socket(server):
    health = server.http("/healthz")
    assert {k: health[k] for k in ("status", "sessions", "max_sessions")} == {
        "status": "ok",
        "sessions": 0,
        "max_sessions": 3,
    }
    model = server.http("/v1/model")
    assert model["protocol"] == "rolldiff-stream/1" and model["height"] == 32 and model["chunk_frames"] == 3
    assert model["max_batch"] == 8  # the default: sessions that line up share one forward per step
    # on a CPU, groups of 4 or more made at once: the cores over torch's threads (one here: OMP_NUM_THREADS=1)
    assert model["parallel_groups"] == max(1, os.cpu_count() or 1)
    announced = [line for line in server.log.read_text().splitlines() if line.startswith(ANNOUNCED)]
    assert announced == [
        f"rolldiff serve: {server.url}, the page http://127.0.0.1:{server.port}/ (KreaRealtimeVideoPipeline, cpu)"
    ]
    page = announced[0].split("the page ", 1)[1].split(" ", 1)[0]
    with urllib.request.urlopen(page, timeout=5) as response:  # the address announced serves the page
        assert response.headers.get_content_type() == "text/html"


def test_the_models_chunk_is_the_servers_recipes_as_its_sessions_run_it():
    """`--recipe causal-forcing-framewise` makes chunks of one latent frame: `/v1/model` says so (not the model
    config's 3), as a session's `ready` does."""
    server = Server("--recipe", "causal-forcing-framewise")
    try:
        model = server.http("/v1/model")
        assert (model["chunk_frames"], model["latent_chunk_frames"], model["recipe"]) == (
            1,
            1,
            "causal-forcing-framewise",
        )
        assert "infinity-rope" in model["recipes"] and "longsana" not in model["recipes"]  # this pipeline's recipes
        with connect(server.url, prompt=RED, seed=3, num_frames=4) as live:
            assert live.ready["chunk_frames"] == model["chunk_frames"]
    finally:
        server.stop()


def test_an_ipv6_address_is_announced_in_brackets():
    from rolldiff.cli.run_serve import _served_at

    assert _served_at("::1", 8000) == "ws://[::1]:8000/v1/stream, the page http://[::1]:8000/"
    assert _served_at("127.0.0.1", 8000) == "ws://127.0.0.1:8000/v1/stream, the page http://127.0.0.1:8000/"


def test_a_seeded_raw_session_sends_exactly_the_librarys_frames(server, references):
    with connect(server.url, prompt=RED, seed=3, num_frames=FRAMES) as live:
        assert live.ready["protocol"] == "rolldiff-stream/1" and live.ready["num_frames"] == FRAMES
        chunks = list(live)
        headers = live.chunk_headers
    expected = references()
    assert len(chunks) == len(expected) == 8
    assert all((got == want).all() for got, want in zip(chunks, expected))
    assert [h["index"] for h in headers] == list(range(8)) and [h["first_frame"] for h in headers][:2] == [0, 3]
    assert live.done == {"type": "done", "frames": FRAMES, "reason": "complete"}


def test_sessions_batched_side_by_side_each_stay_within_2_of_255_of_their_solo_runs(server, references):
    """Three sessions denoised together (one forward per step for all of them), joining at different chunks so that
    one batch holds caches at different positions and window fills, and leaving at different chunks: each session's
    frames are within 2/255 of its solo run (float reordering in the batched products), and forwards were shared."""
    shared_before = server.http("/healthz")["batched_rows"]
    specs = {"first": (RED, 3), "second": (BLUE, 5), "third": (RED, 7)}
    first = connect(server.url, prompt=RED, seed=3, num_frames=FRAMES)
    clients = {}
    try:
        early = [next(first) for _ in range(3)]  # chunks 0-2 alone; the others join at its chunk 3 (window wrapped)
        clients = {"first": first}
        clients["second"] = connect(server.url, prompt=BLUE, seed=5, num_frames=FRAMES)
        clients["third"] = connect(server.url, prompt=RED, seed=7, num_frames=FRAMES)
        made = round_robin(clients, limit=4 * FRAMES)
    finally:
        for client in [first, *clients.values()]:
            client.close()
    made["first"] = early + made["first"]
    assert server.http("/healthz")["batched_rows"] > shared_before
    for name, (prompt, seed) in specs.items():
        assert max_difference(made[name], references(prompt=prompt, seed=seed)) <= 2, name


def test_with_max_batch_1_sessions_take_turns_and_each_is_its_solo_video_bit_for_bit(references):
    """`--max-batch 1`: sessions interleaved chunk by chunk on one model, each exactly its solo run."""
    server = Server("--max-batch", "1")
    try:
        assert server.http("/v1/model")["max_batch"] == 1
        clients = {
            "first": connect(server.url, prompt=RED, seed=3, num_frames=FRAMES),
            "second": connect(server.url, prompt=BLUE, seed=5, num_frames=FRAMES),
        }
        try:
            made = round_robin(clients, limit=4 * FRAMES)
        finally:
            for client in clients.values():
                client.close()
        assert server.http("/healthz")["batched_rows"] == 0
    finally:
        server.stop()
    for name, prompt, seed in (("first", RED, 3), ("second", BLUE, 5)):
        assert max_difference(made[name], references(prompt=prompt, seed=seed)) == 0, name


def test_a_prompt_switch_lands_at_the_chunk_it_names(server, references):
    with connect(server.url, prompt=RED, seed=3, num_frames=FRAMES) as live:
        chunks = [next(live), next(live)]
        live.pause()  # hold the session so the switch lands where the test then asks the library to switch
        accepted = live.switch_prompt(BLUE)
        live.resume()
        chunks += list(live)
    assert accepted >= 2
    expected = references(switch=(accepted, BLUE))
    assert all((got == want).all() for got, want in zip(chunks, expected))
    assert not all((got == want).all() for got, want in zip(chunks, references()))


def test_a_scene_cut_lands_as_the_librarys_and_a_session_that_cannot_cut_is_told(server, references):
    """`"scene_cut": true` under `"recipe": "infinity-rope"`: the library's cut at the chunk `prompt.accepted` names.
    Under `self-forcing` (absolute positions) the same message is refused naming `scene_cut`, and the video goes on."""
    with connect(server.url, prompt=RED, seed=3, num_frames=FRAMES, recipe="infinity-rope") as live:
        chunks = [next(live), next(live)]
        live.pause()
        accepted = live.switch_prompt(BLUE, scene_cut=True)
        live.resume()
        chunks += list(live)
    assert max_difference(chunks, references(switch=(accepted, BLUE, True), recipe="infinity-rope")) == 0
    assert max_difference(chunks, references(switch=(accepted, BLUE), recipe="infinity-rope")) > 0
    with _raw(server.url) as socket:
        socket.send(json.dumps({"type": "start", "prompt": RED, "num_frames": 6, "recipe": "self-forcing"}))
        assert json.loads(socket.recv(timeout=30))["type"] == "ready"
        socket.send(json.dumps({"type": "prompt", "prompt": BLUE, "scene_cut": True}))
        messages, code = _messages_until_close(socket)
    errors = [m for m in messages if m["type"] == "error"]
    assert [(e["code"], e["field"]) for e in errors] == [("bad_request", "prompt")]
    assert (
        "`scene_cut` places a cut chunk" in errors[0]["message"] and "position_mode='absolute'" in errors[0]["message"]
    )
    assert messages[-1] == {"type": "done", "frames": 6, "reason": "complete"} and code == 1000


def test_jpeg_and_png_formats_send_decodable_frames(server, references):
    expected = references()
    for output, tolerance in (("png", 0), ("jpeg", 40)):
        with connect(server.url, prompt=RED, seed=3, num_frames=6, format=output) as live:
            chunks = list(live)
        assert len(chunks) == 2 and chunks[0].shape == (3, 32, 32, 3)
        assert np.abs(chunks[0].astype(int) - expected[0].astype(int)).mean() <= tolerance


def test_suspend_then_restore_continues_the_uninterrupted_video(server, references):
    live = connect(server.url, prompt=RED, seed=3, num_frames=FRAMES)
    chunks = [next(live), next(live)]
    token = live.suspend()
    chunks += list(live)  # made before the cut
    live.close()
    assert server.sessions_within(0)
    resumed = restore(server.url, token)
    assert resumed.ready["next_chunk"] == len(chunks)
    chunks += list(resumed)
    expected = references()
    assert len(chunks) == len(expected)
    assert all((got == want).all() for got, want in zip(chunks, expected))


def test_image_to_video_session_is_the_librarys(server, references, tmp_path):
    image = np.zeros((32, 32, 3), dtype=np.uint8)
    image[8:16, 8:16] = (255, 0, 0)
    PIL.Image.fromarray(image).save(tmp_path / "start.png")
    expected = references(seed=1, image=image)
    for given in (image, tmp_path / "start.png"):  # an array, or a picture file's path, as the library takes
        with connect(server.url, prompt=RED, seed=1, num_frames=FRAMES, image=given) as live:
            chunks = list(live)
        assert len(chunks) == len(expected) and all((got == want).all() for got, want in zip(chunks, expected))


def test_a_start_image_path_the_client_cannot_read_is_refused_before_connecting(tmp_path):
    """As the library's `image=`: named, with the path, before any socket opens (port 9 has no server)."""
    (tmp_path / "notes.png").write_text("not a picture")
    with pytest.raises(ValueError, match=r"`image` '.*nope.png' is not a file"):
        connect("ws://127.0.0.1:9/v1/stream", prompt=RED, image=tmp_path / "nope.png")
    with pytest.raises(ValueError, match=r"`image` '.*notes.png' cannot be read as a picture"):
        connect("ws://127.0.0.1:9/v1/stream", prompt=RED, image=str(tmp_path / "notes.png"))


def test_video_input_follows_the_input_chunk_by_chunk(server, references):
    rng = np.random.default_rng(0)
    video = rng.integers(0, 255, size=(12, 32, 32, 3), dtype=np.uint8)
    with connect(server.url, prompt=RED, seed=2, num_frames=FRAMES, input="video", strength=0.5) as live:
        live.send_frames(video)
        live.end_input()
        chunks = list(live)
    assert sum(len(c) for c in chunks) == 12  # the output ends with the input
    expected = references(seed=2, video=video, strength=0.5)
    assert all((got == want).all() for got, want in zip(chunks, expected))


# ---------------------------------------------------------------------------------------- refusals
def test_bad_messages_mid_session_are_answered_and_the_session_goes_on(server):
    with _raw(server.url) as socket:
        socket.send(json.dumps({"type": "start", "prompt": RED, "seed": 0, "num_frames": 6}))
        assert json.loads(socket.recv(timeout=30))["type"] == "ready"
        socket.send(json.dumps({"type": "pause"}))
        errors = []
        for bad in ("{not json", json.dumps({"type": "dance"}), json.dumps({"type": "prompt", "prompt": 3}),
                    json.dumps({"type": "prompt", "prompt": RED, "blend_chunks": 0}), json.dumps([1, 2])):  # fmt: skip
            socket.send(bad)
        socket.send(b"\x89PNG not a frame")
        socket.send(json.dumps({"type": "resume"}))
        messages, code = _messages_until_close(socket)
        errors = [m for m in messages if m["type"] == "error"]
    assert [e["code"] for e in errors] == ["bad_request"] * 6
    assert [e["field"] for e in errors[1:4]] == ["type", "prompt", "blend_chunks"]
    assert messages[-1] == {"type": "done", "frames": 6, "reason": "complete"} and code == 1000


@pytest.mark.parametrize(
    "first, field",
    [
        (b"binary first", None),
        (json.dumps({"type": "start", "prompt": RED, "num_frames": 5}), "num_frames"),
        (json.dumps({"type": "start", "prompt": RED, "height": 33}), "height"),
        (json.dumps({"type": "start", "prompt": RED, "format": "gif"}), "format"),
        (json.dumps({"type": "start", "prompt": RED, "seed": "zero"}), "seed"),
        (json.dumps({"type": "start", "prompt": RED, "recipe": "longsana"}), "recipe"),
        (json.dumps({"type": "ping"}), None),
    ],
)
def test_a_bad_first_message_closes_with_1008_naming_the_field(server, first, field):
    with _raw(server.url) as socket:
        socket.send(first)
        messages, code = _messages_until_close(socket)
    assert code == 1008 and messages[0]["type"] == "error" and messages[0]["code"] == "bad_request"
    assert messages[0]["field"] == field
    assert server.sessions_within(0)


@pytest.mark.parametrize("token", ["../../../etc/passwd", "a" * 31, "A" * 32, "x/" * 16, None, 7])
def test_a_restore_token_the_server_did_not_issue_is_not_found(server, token):
    with _raw(server.url) as socket:
        socket.send(json.dumps({"type": "restore", "token": token}))
        messages, code = _messages_until_close(socket)
    assert messages[0]["code"] == "not_found" and code == 1008


def test_a_client_that_disconnects_mid_chunk_frees_its_session(server):
    with _raw(server.url) as socket:
        socket.send(json.dumps({"type": "start", "prompt": RED, "num_frames": None}))
        assert json.loads(socket.recv(timeout=30))["type"] == "ready"
        socket.recv(timeout=30)  # the first chunk is on its way
        assert server.http("/healthz")["sessions"] == 1
        socket.close()  # mid-stream, the way a closed browser tab leaves
        assert server.sessions_within(0, seconds=10)


def test_too_many_sessions_close_with_1013(state_dir):
    server = Server("--max-sessions", "1")
    try:
        with connect(server.url, prompt=RED, num_frames=None) as first:
            next(first)
            with _raw(server.url) as socket:
                socket.send(json.dumps({"type": "start", "prompt": RED}))
                messages, code = _messages_until_close(socket)
            assert messages[0]["code"] == "busy" and code == 1013
            assert next(first).shape == (3, 32, 32, 3)  # the first session goes on
    finally:
        server.stop()


def test_frames_are_sent_uncompressed_even_to_a_client_offering_deflate(server):
    """permessage-deflate costs the one event loop about 111 ms per 480x832 raw frame to save 3 %: never agreed."""
    with ws_connect(server.url, compression="deflate") as socket:  # offers permessage-deflate
        assert "permessage-deflate" in socket.request.headers.get("Sec-WebSocket-Extensions", "")
        assert socket.response.headers.get("Sec-WebSocket-Extensions") is None
        socket.send(json.dumps({"type": "start", "prompt": RED, "num_frames": 3, "seed": 0}))
        assert json.loads(socket.recv(timeout=30))["type"] == "ready"
        assert json.loads(socket.recv(timeout=60))["type"] == "chunk"
        assert len(socket.recv(timeout=30)) == 32 * 32 * 3  # a raw frame, as sent


def test_an_oversized_message_closes_with_1009(server):
    with _raw(server.url) as socket:
        socket.send(json.dumps({"type": "start", "prompt": RED, "input": "video"}))
        assert json.loads(socket.recv(timeout=30))["type"] == "ready"
        socket.send(b"\0" * (9 * 2**20))
        messages, code = _messages_until_close(socket)
    assert code == 1009
    assert messages[-1]["code"] == "too_large" and str(8 * 2**20) in messages[-1]["message"]
    assert server.sessions_within(0)


def test_a_token_is_required_by_header_or_query(state_dir):
    server = Server(env={"ROLLDIFF_TOKEN": "s3cret"})
    try:
        with _raw(server.url) as socket:  # refused at once, before any message
            messages, code = _messages_until_close(socket)
        assert messages[0]["code"] == "unauthorized" and code == 1008
        with connect(server.url, prompt=RED, num_frames=3, token="s3cret") as live:
            assert len(list(live)) == 1
        with connect(server.url + "?token=s3cret", prompt=RED, num_frames=3) as live:
            assert len(list(live)) == 1
        with pytest.raises((ProtocolError, ConnectionError)):
            connect(server.url + "?token=wrong", prompt=RED, num_frames=3)
    finally:
        server.stop()


def test_binding_beyond_loopback_without_a_token_is_refused(capsys, monkeypatch):
    monkeypatch.delenv("ROLLDIFF_TOKEN", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "--token" in capsys.readouterr().err


@pytest.mark.parametrize(("recipe", "latent_frames"), [("self-forcing", 1023), ("rolling-sink", 99999)])
def test_until_stopped_is_the_longest_video_the_sessions_positions_allow(recipe, latent_frames):
    """`"num_frames": null` (the browser page's sessions) under a recipe of absolute positions ends at the RoPE table
    (1024 latent frames, in whole chunks of 3), where asking for `--max-frames` was refused; relative positions
    (Rolling Sink) run to `--max-frames`."""
    from rolldiff.defaults import load_pipeline
    from rolldiff.serving.app import PAGE_PROMPT, ServeSettings, session_request

    pipe = load_pipeline("tiny-bouncing-shapes", device="cpu", dtype="float32")
    settings = ServeSettings(model="tiny-bouncing-shapes", max_frames=99999)
    request = session_request(pipe, settings, {"prompt": PAGE_PROMPT, "recipe": recipe}, None)
    assert request.geometry.num_latent_frames == latent_frames
    with pytest.raises(ValueError, match="RoPE table"):  # what a session "until stopped" asked for before
        session_request(pipe, settings, {"prompt": PAGE_PROMPT, "recipe": "self-forcing"}, 99999)


def test_parallel_groups_below_1_is_refused_naming_the_flag(capsys):
    assert main(["serve", "--parallel-groups", "0", "--port", str(free_port())]) == 2
    assert "--parallel-groups" in capsys.readouterr().err


@pytest.mark.parametrize("other", [["--max-batch", "1"], ["--compile", "eager"]])
def test_parallel_groups_without_batching_is_refused_naming_both_flags(capsys, other):
    assert main(["serve", "--parallel-groups", "2", *other, "--port", str(free_port())]) == 2
    error = capsys.readouterr().err
    assert "--parallel-groups" in error and other[0] in error


def test_a_default_recipe_that_cannot_run_compiled_is_refused_at_start(capsys):
    """StreamDiffusionV2's sessions decide each write on the host (sequential denoising): every session of such a
    server would be refused by the request builder, so the server is, at start, naming both flags."""
    assert main(["serve", "--recipe", "streamdiffusionv2", "--compile", "eager", "--port", str(free_port())]) == 2
    error = capsys.readouterr().err
    assert "--compile" in error and "--recipe streamdiffusionv2" in error


# ---------------------------------------------------------------------------------------- restarts
def test_sigterm_suspends_every_session_and_a_new_server_restores_it(tmp_path, references):
    server = Server("--state-dir", str(tmp_path))
    live = connect(server.url, prompt=RED, seed=3, num_frames=FRAMES)
    chunks = [next(live), next(live)]
    live.pause()
    assert server.stop(signal.SIGTERM) == 0
    chunks += list(live)  # made before the cut
    assert live.done["type"] == "suspended" and live.done["reason"] == "shutdown"
    token = live.done["token"]
    again = Server("--state-dir", str(tmp_path))
    try:
        chunks += list(restore(again.url, token))
    finally:
        again.stop()
    expected = references()
    assert len(chunks) == len(expected) and all((g == w).all() for g, w in zip(chunks, expected))
    assert list(tmp_path.glob("*.resume.safetensors")) == []  # restored and finished: nothing left to restore


def test_with_state_every_a_session_survives_sigkill_from_its_last_saved_chunk(tmp_path, references):
    server = Server("--state-dir", str(tmp_path), "--state-every", "1")
    chunks, start, rest = killed_then_restored(server, lambda: Server("--state-dir", str(tmp_path)))
    assert start == len(chunks) < 8  # it goes on right after the last chunk the client got: no gap, no repeat
    expected = references()
    assert all((g == w).all() for g, w in zip(chunks, expected))
    assert all((g == w).all() for g, w in zip(rest, expected[start:])) and len(rest) == 8 - start
    assert list(tmp_path.glob("*.resume.safetensors")) == []


def test_with_state_every_finished_sessions_leave_no_saved_state(tmp_path, references):
    """Each chunk's state is written by the connection after the chunk is sent, which can come after the scheduler
    has finished the session: the store drops such late saves, so the folder does not fill with ended sessions."""
    server = Server("--state-dir", str(tmp_path), "--state-every", "1")
    try:
        done = []
        for seed in (3, 4):
            with connect(server.url, prompt=RED, seed=seed, num_frames=FRAMES) as live:
                chunks = list(live)
                done.append(live.done["reason"])
        assert done == ["complete", "complete"] and len(chunks) == 8
    finally:
        server.stop()
    assert list(tmp_path.glob("*.resume.safetensors")) == []


def test_limits_idle_time_frame_size_and_length():
    import io

    import PIL.Image

    server = Server("--idle-timeout", "1", "--max-frames", "30")
    try:
        with _raw(server.url) as socket:  # longer than the server allows
            socket.send(json.dumps({"type": "start", "prompt": RED, "num_frames": 33}))
            messages, code = _messages_until_close(socket)
        assert messages[0]["code"] == "too_large" and messages[0]["field"] == "num_frames" and code == 1008
        huge = io.BytesIO()
        PIL.Image.new("RGB", (5000, 5000)).save(huge, format="PNG")  # 25 Mpixel, a few KiB of PNG
        with _raw(server.url) as socket:  # a video session that gets no usable frame, then goes idle
            socket.send(json.dumps({"type": "start", "prompt": RED, "num_frames": None, "input": "video"}))
            assert json.loads(socket.recv(timeout=30))["type"] == "ready"
            socket.send(huge.getvalue())
            messages, code = _messages_until_close(socket)
        assert messages[0]["code"] == "too_large" and messages[0]["field"] == "input"
        assert messages[-1] == {"type": "done", "frames": 0, "reason": "idle"} and code == 1000
        assert server.sessions_within(0)
    finally:
        server.stop()


def test_sigterm_without_a_state_dir_ends_every_session_saying_so():
    server = Server()
    live = connect(server.url, prompt=RED, num_frames=None)
    next(live)
    live.pause()
    started = time.monotonic()
    assert server.stop(signal.SIGTERM) == 0
    list(live)
    assert live.done == {"type": "done", "frames": live.done["frames"], "reason": "shutdown"}
    assert time.monotonic() - started < 30  # the session ended at once: the shutdown did not wait it out

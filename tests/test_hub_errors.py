"""A Hub id that cannot be loaded says why: offline, unreachable, no such repository, or not a pipeline repository.

diffusers reports all four as "does not appear to have a file named model_index.json". The Hub here is a local
HTTP server answering as the Hub does (status and `X-Error-Code`), or a closed port; the cache is empty.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import huggingface_hub.constants as hub_constants
import pytest

from rolldiff.defaults import ModelNotFoundError, pipeline_class

# repository id -> the Hub's answer to a request for its model_index.json: (status, X-Error-Code)
ANSWERS = {"org/no-such-repo": (404, "RepoNotFound"), "org/original-checkpoint": (404, "EntryNotFound")}


class _HubLike(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        repo_id = "/".join(self.path.strip("/").split("/")[:2])
        status, code = ANSWERS.get(repo_id, (500, ""))
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET = _answer

    def log_message(self, *args) -> None:
        pass


def _point_the_hub_at(endpoint: str, monkeypatch) -> None:
    """What HF_ENDPOINT does, after huggingface_hub has read it at import."""
    monkeypatch.setattr(hub_constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(
        hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub(empty_cache, monkeypatch) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HubLike)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    _point_the_hub_at(endpoint, monkeypatch)
    try:
        yield endpoint
    finally:
        server.shutdown()
        server.server_close()


def test_offline_mode_names_hf_hub_offline(empty_cache, monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError) as caught:
        pipeline_class("krea/krea-realtime-video")
    message = str(caught.value)
    assert "HF_HUB_OFFLINE is set" in message and "not in the local cache" in message
    assert "does not appear to have a file" not in message


def test_an_unreachable_hub_is_named_with_its_cause(empty_cache, monkeypatch):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    _point_the_hub_at(f"http://127.0.0.1:{closed_port}", monkeypatch)
    monkeypatch.setattr("huggingface_hub.utils._http.time.sleep", lambda seconds: None)  # its retries' back-off
    with pytest.raises(ModelNotFoundError) as caught:
        pipeline_class("krea/krea-realtime-video")
    message = str(caught.value)
    assert "could not reach the Hugging Face Hub" in message and "Connection refused" in message
    assert "HF_HUB_OFFLINE=1" in message and "does not appear to have a file" not in message


def test_a_repository_the_hub_does_not_have_lists_the_embedded_models(hub):
    with pytest.raises(ModelNotFoundError) as caught:
        pipeline_class("org/no-such-repo")
    message = str(caught.value)
    assert "no such repository on the Hugging Face Hub" in message and "hf auth login" in message
    assert "(tiny-bouncing-shapes, tiny-bouncing-shapes-sana)" in message


def test_a_repository_without_model_index_points_to_rolldiff_convert(hub):
    with pytest.raises(ModelNotFoundError) as caught:
        pipeline_class("org/original-checkpoint")
    message = str(caught.value)
    assert "has no model_index.json" in message
    assert "hf download org/original-checkpoint FILE" in message and "rolldiff convert FILE --base" in message


def test_the_command_says_it_in_one_line_without_library_warnings(empty_cache, monkeypatch, capsys):
    from rolldiff.cli import main

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    assert main(["generate", "--model", "krea/krea-realtime-video", "--prompt", "a red circle"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rolldiff: error: --model 'krea/krea-realtime-video': HF_HUB")

"""SessionStore: a session's saved state in a folder or under an fsspec URL (`file://` here, as `s3://` would be);
once the session has ended, nothing of it stays or comes back."""

import threading

import pytest
import torch

from rolldiff.pipelines.io import resume
from rolldiff.serving import ProtocolError
from rolldiff.serving.store import SessionStore

START = {"prompt": "a red circle", "seed": 0, "image": None}
TOKEN = "A" * 32


def _state(value: float) -> dict:
    return {"cache": torch.full((4,), value)}


def test_a_newer_state_replaces_an_older_one_and_an_older_one_is_dropped(tmp_path):
    store = SessionStore(tmp_path, "model")
    store.save(TOKEN, START, 6, _state(6.0))
    store.save(TOKEN, START, 3, _state(3.0))  # a chunk's snapshot that comes after a later suspend
    start, frames, state = store.load(TOKEN)
    assert start == START and frames == 6 and torch.equal(state["cache"], torch.full((4,), 6.0))


def test_a_save_after_the_session_ended_is_dropped(tmp_path):
    store = SessionStore(tmp_path, "model")
    store.save(TOKEN, START, 3, _state(3.0))
    store.delete(TOKEN)
    store.save(TOKEN, START, 9, _state(9.0))  # the last chunk's snapshot, written after the session was finished
    assert list(tmp_path.iterdir()) == []


def test_ending_a_session_during_its_save_leaves_nothing_and_does_not_wait(tmp_path, monkeypatch):
    store = SessionStore(tmp_path, "model")
    writing, release = threading.Event(), threading.Event()
    save_state = resume.save_state

    def slow_save(path, run_state):
        writing.set()
        release.wait(10)
        save_state(path, run_state)

    monkeypatch.setattr("rolldiff.serving.store.save_state", slow_save)
    saver = threading.Thread(target=store.save, args=(TOKEN, START, 3, _state(3.0)))
    saver.start()
    assert writing.wait(10)  # the save is under way
    ender = threading.Thread(target=store.delete, args=(TOKEN,))
    ender.start()
    ender.join(5)
    assert not ender.is_alive()  # the scheduler's thread is never held up by a write
    release.set()
    saver.join(10)
    ender.join(10)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------- an fsspec URL
def test_a_file_url_keeps_states_as_a_folder_does(tmp_path):
    store = SessionStore(tmp_path.as_uri(), "model")  # file:///...: through fsspec, as s3:// would be
    store.save(TOKEN, START, 6, _state(6.0))
    store.save(TOKEN, START, 3, _state(3.0))  # older: dropped
    start, frames, state = store.load(TOKEN)
    assert start == START and frames == 6 and torch.equal(state["cache"], torch.full((4,), 6.0))
    assert [path.name for path in tmp_path.iterdir()] == [f"{TOKEN}.resume.safetensors"]  # no temporary left
    again = SessionStore(tmp_path.as_uri(), "model")  # another server (a replica elsewhere) reads it
    assert again.load(TOKEN)[1] == 6
    store.delete(TOKEN)
    store.save(TOKEN, START, 9, _state(9.0))  # after the end: dropped
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ProtocolError) as missing:
        again.load(TOKEN)
    assert missing.value.code == "not_found"


def test_a_file_url_state_is_the_same_file_a_folder_writes(tmp_path):
    SessionStore(tmp_path / "folder", "model").save(TOKEN, START, 6, _state(6.0))
    (tmp_path / "url").mkdir()
    name = f"{TOKEN}.resume.safetensors"
    (tmp_path / "url" / name).write_bytes((tmp_path / "folder" / name).read_bytes())
    assert SessionStore((tmp_path / "url").as_uri(), "model").load(TOKEN)[1] == 6


def test_a_damaged_state_under_a_url_is_not_found_not_a_crash(tmp_path):
    (tmp_path / f"{TOKEN}.resume.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ProtocolError) as damaged:
        SessionStore(tmp_path.as_uri(), "model").load(TOKEN)
    assert damaged.value.code == "not_found" and "not a readable resume state" in str(damaged.value)


def test_memory_urls_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"`state_dir` 'memory://sessions': memory:// lives in one process"):
        SessionStore("memory://sessions", "model")


def test_an_unknown_url_scheme_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"`state_dir` 'nosuch://x': fsspec cannot open nosuch://"):
        SessionStore("nosuch://x", "model")

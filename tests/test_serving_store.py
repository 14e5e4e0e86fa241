"""SessionStore: a session's saved state on disk; once the session has ended, nothing of it stays or comes back."""

import threading

import torch

from rolldiff.pipelines.io import resume
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

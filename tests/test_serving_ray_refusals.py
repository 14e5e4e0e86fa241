"""`rolldiff serve --ray` refused before anything starts, each with one line that names the flag. A module of its
own, after the live servers' modules: `--ray-address auto` finds any Ray cluster running on this machine (Ray looks
for GCS processes too), so it runs where no test's cluster is up."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from serve_helpers import free_port, refused_joining, until

from rolldiff.cli import main

pytest.importorskip("ray.serve", reason='pip install "rolldiff[ray]" (the dev extra) to run it')

pytestmark = pytest.mark.usefixtures("one_ray_cluster_at_a_time")  # (conftest) under pytest-xdist too


def test_ray_and_workers_together_are_refused_naming_both(capsys):
    assert main(["serve", "--ray", "--workers", "2", "--device", "cpu", "--port", str(free_port())]) == 2
    error = capsys.readouterr().err
    assert "--ray and --workers 2" in error and error.count("\n") == 1


def test_more_replicas_than_cores_are_refused_before_anything_starts(capsys):
    cores = os.cpu_count() or 1
    assert main(["serve", "--ray", "--replicas", str(cores + 1), "--device", "cpu", "--port", str(free_port())]) == 2
    assert f"--replicas {cores + 1}: 1 to {cores}, at most one per core" in capsys.readouterr().err


def test_on_gpus_replicas_are_one_per_gpu_and_each_gets_its_own(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main(["serve", "--ray", "--replicas", "3", "--device", "cuda", "--port", str(free_port())]) == 2
    assert "--replicas 3: 1 to 2, at most one per GPU, and this machine has 2" in capsys.readouterr().err
    assert main(["serve", "--ray", "--device", "cuda:1", "--port", str(free_port())]) == 2
    assert "--device cuda:1: under --ray each replica gets a GPU of its own" in capsys.readouterr().err


def test_replicas_below_1_are_refused(capsys):
    assert main(["serve", "--ray", "--replicas", "0"]) == 2
    assert "argument --replicas: expected a finite int > 0, got '0'" in capsys.readouterr().err


def test_replicas_without_ray_are_refused(capsys):
    assert main(["serve", "--replicas", "2", "--device", "cpu", "--port", str(free_port())]) == 2
    assert "--replicas goes with --ray" in capsys.readouterr().err


def test_an_address_where_nothing_answers_is_refused_in_seconds_before_anything_starts(capsys):
    port = free_port()  # nothing listens on it
    started = time.monotonic()
    assert main(["serve", "--ray", "--ray-address", f"127.0.0.1:{port}", "--device", "cpu"]) == 2
    error = capsys.readouterr().err
    assert f"--ray-address 127.0.0.1:{port}: nothing answers there" in error and error.count("\n") == 1
    assert time.monotonic() - started < 30  # where ray.init retries for minutes
    assert main(["serve", "--ray", "--ray-address", "head-without-port", "--device", "cpu"]) == 2
    assert "--ray-address 'head-without-port': give the head's HOST:PORT" in capsys.readouterr().err


def _gcs_servers() -> list[int]:
    """Ray's GCS processes on this machine, which `--ray-address auto` also finds (by their command lines)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"gcs_server" in (entry / "cmdline").read_bytes().split(b"\0")[0]:
                found.append(int(entry.name))
        except OSError:  # gone since it was listed
            continue
    return found


def test_auto_where_no_cluster_runs_says_so_in_our_flags_words(tmp_path):
    """`--ray-address auto` with no RAY_ADDRESS and no `ray start` cluster (Ray looks in RAY_TMPDIR, an empty
    folder here): one line that names our flag and what to do, not Ray's `--address`."""
    assert until(lambda: not _gcs_servers(), 60), f"an earlier test's Ray cluster still runs: {_gcs_servers()}"
    refusal = refused_joining("auto", env={"RAY_TMPDIR": str(tmp_path)})  # (this process has no RAY_ADDRESS)
    assert "--ray-address auto: RAY_ADDRESS is not set and no `ray start` cluster runs on this machine" in refusal
    assert "--address" not in refusal.replace("--ray-address", "")


def test_a_state_dir_in_one_processs_memory_is_refused(capsys):
    assert main(["serve", "--ray", "--device", "cpu", "--state-dir", "memory://sessions"]) == 2
    error = capsys.readouterr().err
    assert "--state-dir 'memory://sessions'" in error and "memory://" in error


def test_a_joining_servers_address_is_checked_for_its_form_before_anything_starts(capsys):
    """Joining, the port is the cluster's nodes' to bind (not probed here), but a port or host no node could use is
    refused before Ray is asked anything."""
    head = f"127.0.0.1:{free_port()}"  # nothing answers there: a refusal that got past the address would say so
    assert main(["serve", "--ray", "--ray-address", head, "--device", "cpu", "--port", "70000"]) == 2
    error = capsys.readouterr().err
    assert "--port must be a whole number from 1 to 65535, got 70000" in error and "nothing answers" not in error
    assert (
        main(["serve", "--ray", "--ray-address", head, "--device", "cpu", "--host", "999.1.1.1", "--token", "t"]) == 2
    )
    assert "--host '999.1.1.1' is not a valid IPv4 address" in capsys.readouterr().err
